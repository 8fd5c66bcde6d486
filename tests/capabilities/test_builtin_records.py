"""The built-in records field by field against ``builtin_records.json``: ``builtin.py`` builds
records from smaller ones (``dataclasses.replace``), so a change to one shared piece reaches
several EPs; this pins what each record says, dtype by dtype and in order, so that such a
change is seen. A deliberate change to a record updates the JSON with it (regenerate with
``python tests/capabilities/test_builtin_records.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from epfuse.capabilities.builtin import BUILTIN
from epfuse.capabilities.records import EPCapabilities

EXPECTED = Path(__file__).with_name("builtin_records.json")


def dump(record: EPCapabilities) -> dict[str, Any]:
    """Every field of ``record`` as JSON data, dtypes in the record's order."""
    data = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    data["dtypes"] = {k: dataclasses.asdict(v) for k, v in record.dtypes.items()}
    data["notes"] = list(data["notes"])
    return data


def test_every_builtin_record_is_as_recorded():
    got = [dump(r) for r in BUILTIN]
    want = json.loads(EXPECTED.read_text())
    assert [r["name"] for r in got] == [r["name"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert list(g["dtypes"]) == list(w["dtypes"]), g["name"]  # the order eps lists
        assert g == w, g["name"]


if __name__ == "__main__":
    EXPECTED.write_text(json.dumps([dump(r) for r in BUILTIN], indent=1) + "\n")

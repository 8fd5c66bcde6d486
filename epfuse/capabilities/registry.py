"""Registry of capability records, keyed by short name and by ORT provider name."""

from __future__ import annotations

from epfuse.errors import UnknownEPError

from .builtin import BUILTIN
from .records import EPCapabilities

_RECORDS: dict[str, EPCapabilities] = {}
_ALIASES: dict[str, str] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register_ep(record: EPCapabilities, *, aliases: tuple[str, ...] = (), replace: bool = False):
    """Add (or with ``replace=True`` override) a record; its provider name becomes an alias."""
    key = _key(record.name)
    if key in _RECORDS and not replace:
        raise ValueError(f"EP {record.name!r} is already registered (pass replace=True)")
    _RECORDS[key] = record
    names = [record.name, *aliases]
    if record.provider:
        names.append(record.provider)
    for alias in names:
        _ALIASES[_key(alias)] = key
    return record


def get_ep(name: str | EPCapabilities) -> EPCapabilities:
    """Resolve ``cuda``, ``CUDAExecutionProvider`` or a record itself."""
    if isinstance(name, EPCapabilities):
        return name
    key = _ALIASES.get(_key(str(name)))
    if key is None:
        raise UnknownEPError(
            f"unknown execution provider {name!r}; known: {', '.join(known_eps())}"
        )
    return _RECORDS[key]


def known_eps() -> list[str]:
    return [record.name for record in _RECORDS.values()]


def all_eps() -> list[EPCapabilities]:
    return list(_RECORDS.values())


for _record in BUILTIN:
    register_ep(_record)

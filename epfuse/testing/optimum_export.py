"""Export tiny random-weight Hugging Face decoders with Hugging Face Optimum.

Optimum (``optimum-cli export onnx --task text-generation-with-past``) drives torch.onnx's
TorchScript exporter (``dynamo=False``) at opset 14-18; it made most ONNX language models that
people download. Its graphs differ from dynamo's: the mask is built with ``Where``/``finfo.min``
and guarded against NaN after the softmax, shapes flow through ``Shape``/``Gather``/``Concat``
chains of ``Constant`` nodes, RoPE is traced from transformers 4.x's rotary module.

``optimum-onnx`` pins transformers 4.57.x, which conflicts with the ``export`` extra's
transformers 5.x, so this module needs its own environment (the ``optimum`` extra, installed in
a second virtual environment by ``.ci/run``). The weights are the same seeded random weights as
:func:`epfuse.testing.hf_export.hf_model`'s, so :func:`epfuse.testing.hf_export.hf_reference`
run in the same environment is the Hugging Face reference of the export.

The exported interface is Optimum's: inputs ``input_ids``, ``attention_mask`` (B, P+S),
``position_ids`` (B, S), ``past_key_values.{l}.key``/``.value`` (B, Nkv, P, H); outputs
``logits``, ``present.{l}.key``/``.value``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from epfuse.testing.hf_export import _build_model, _quiet


def optimum_available() -> bool:
    """True when optimum's ONNX exporter can be imported here."""
    try:
        import optimum.exporters.onnx  # noqa: F401
    except ImportError:
        return False
    return True


def export_optimum_decoder(
    config,
    out_dir: str | Path,
    *,
    seed: int = 0,
    opset: int | None = None,
    initializer_range: float | None = None,
) -> Path:
    """Export the seeded random-weight causal LM of ``config`` with Optimum into ``out_dir``.

    ``opset=None`` is Optimum's default for the architecture (18 for Llama-like decoders).
    Returns the path of ``model.onnx`` (weights inline: tiny models stay under 2 GB).
    """
    from optimum.exporters.onnx import main_export

    out_dir = Path(out_dir)
    model, _ = _build_model(config, seed, initializer_range)
    with tempfile.TemporaryDirectory(prefix="epfuse-hf-") as hf_dir, _quiet():
        model.save_pretrained(hf_dir)
        main_export(
            hf_dir,
            output=out_dir,
            task="text-generation-with-past",
            opset=opset,
            device="cpu",
            do_validation=False,
            no_post_process=False,
        )
    path = out_dir / "model.onnx"
    if not path.exists():
        raise RuntimeError(f"optimum wrote no model.onnx into {out_dir}")
    return path

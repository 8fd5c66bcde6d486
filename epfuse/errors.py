"""Errors epfuse raises on purpose; each carries a one-line message fit for a CLI user.

Every class derives from :class:`EpfuseError` (catch that for "epfuse refused"), and, where a
caller would otherwise catch a built-in, also from that built-in: a wrong argument type is a
``TypeError``, a bad option value a ``ValueError``, an output that cannot be written an
``OSError``. The CLI prints ``epfuse: error: <str(err)>`` and exits 1 for every one of them.
"""


class EpfuseError(Exception):
    """Base class. ``str(err)`` is a complete one-line explanation."""


class ModelLoadError(EpfuseError):
    """The input is missing, unreadable, not ONNX, truncated, at an opset ONNX does not know,
    or reads external data from outside its folder."""


class ModelTypeError(EpfuseError, TypeError):
    """``optimize`` got something that is not a path, an ``onnx.ModelProto`` or an
    ``onnx_ir.Model`` (an ``int``, ``bytes``, ``None``, a ``GraphProto`` ...)."""


class OptionError(EpfuseError, ValueError, TypeError):
    """An option has the wrong type or value (``max_seq_len=0``, ``max_seq_len=2.5``, a
    cos/sin cache that cannot be allocated)."""


class UnknownEPError(EpfuseError, ValueError):
    """The execution provider name is not in the capability registry."""


class UnsupportedModelError(EpfuseError):
    """The model is valid ONNX but outside what epfuse optimizes (dtype, no attention, a vendor
    op the EP lacks and no exact standard form exists for, ...)."""


class ConfigError(EpfuseError, ValueError):
    """A Hugging Face ``config.json`` (``--hf-config``) is not JSON or does not describe the
    graph (head counts, layers, vocabulary, hidden size)."""


class OutputError(EpfuseError, OSError):
    """An output (model, its external data, the report, a genai folder) cannot be written, or
    writing it would overwrite a file the input model reads. Nothing is left behind."""


class ValidationError(EpfuseError):
    """The rewritten model failed final validation; it is never returned."""


class VerificationError(EpfuseError):
    """``optimize(verify=True)`` could not produce a model equivalent to the original (or the
    original itself does not run on ORT CPU, so nothing can be verified)."""

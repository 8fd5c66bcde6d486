"""Errors epfuse raises on purpose; each carries a one-line message fit for a CLI user."""


class EpfuseError(Exception):
    """Base class. ``str(err)`` is a complete one-line explanation."""


class ModelLoadError(EpfuseError):
    """The input is missing, unreadable, not ONNX, or truncated."""


class UnknownEPError(EpfuseError, ValueError):
    """The execution provider name is not in the capability registry."""


class UnsupportedModelError(EpfuseError):
    """The model is valid ONNX but outside what epfuse optimizes (dtype, no attention, ...)."""


class ValidationError(EpfuseError):
    """The rewritten model failed final validation; it is never returned."""


class VerificationError(EpfuseError):
    """``optimize(verify=True)`` could not produce a model equivalent to the original (or the
    original itself does not run on ORT CPU, so nothing can be verified)."""

"""epfuse: rewrite generically exported ONNX language models for the ONNX Runtime execution
provider they will run on.

    import epfuse
    optimized = epfuse.optimize("model.onnx", ep="cpu")
"""

import importlib

# Names load on first use (PEP 562): `epfuse.optimizer.cli` must start without importing onnx
# and ORT, so that it can install its signal handlers before the slow imports.
_EXPORTS = {
    "EPCapabilities": "epfuse.capabilities",
    "GQASupport": "epfuse.capabilities",
    "OpSupport": "epfuse.capabilities",
    "get_ep": "epfuse.capabilities",
    "known_eps": "epfuse.capabilities",
    "register_ep": "epfuse.capabilities",
    "ConfigError": "epfuse.errors",
    "EpfuseError": "epfuse.errors",
    "ModelLoadError": "epfuse.errors",
    "ModelTypeError": "epfuse.errors",
    "OptionError": "epfuse.errors",
    "OutputError": "epfuse.errors",
    "UnknownEPError": "epfuse.errors",
    "UnsupportedModelError": "epfuse.errors",
    "ValidationError": "epfuse.errors",
    "VerificationError": "epfuse.errors",
    "optimize": "epfuse.optimizer.api",
    "optimize_with_report": "epfuse.optimizer.api",
    "read_report": "epfuse.optimizer.api",
    "Report": "epfuse.optimizer.report",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)

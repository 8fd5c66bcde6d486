"""epfuse: rewrite generically exported ONNX language models for the ONNX Runtime execution
provider they will run on.

    import epfuse
    optimized = epfuse.optimize("model.onnx", ep="cpu")
"""

from epfuse.capabilities import (
    EPCapabilities,
    GQASupport,
    OpSupport,
    get_ep,
    known_eps,
    register_ep,
)
from epfuse.errors import (
    EpfuseError,
    ModelLoadError,
    UnknownEPError,
    UnsupportedModelError,
    ValidationError,
)
from epfuse.optimizer.api import optimize, optimize_with_report, read_report
from epfuse.optimizer.report import Report

__version__ = "0.1.0"

__all__ = [
    "EPCapabilities",
    "EpfuseError",
    "GQASupport",
    "ModelLoadError",
    "OpSupport",
    "Report",
    "UnknownEPError",
    "UnsupportedModelError",
    "ValidationError",
    "get_ep",
    "known_eps",
    "optimize",
    "optimize_with_report",
    "read_report",
    "register_ep",
]

"""What each execution provider runs, per dtype: data, not logic.

``get_ep("cuda")`` returns a frozen :class:`EPCapabilities`; ``register_ep`` adds a third-party
record. Rewrite rules ask ``record.ops(dtype)`` before emitting anything.
"""

from .records import DTYPES, EPCapabilities, GQASupport, OpSupport
from .registry import all_eps, get_ep, known_eps, register_ep

__all__ = [
    "DTYPES",
    "EPCapabilities",
    "GQASupport",
    "OpSupport",
    "all_eps",
    "get_ep",
    "known_eps",
    "register_ep",
]

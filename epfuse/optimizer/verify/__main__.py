"""``python -m epfuse.optimizer.verify ORIGINAL OPTIMIZED``: the same as ``epfuse verify``."""

from __future__ import annotations

import sys

from epfuse.optimizer.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))

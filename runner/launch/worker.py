"""Entry point of one rank started by this package's launcher: ``python -m runner.launch.worker
PAYLOAD``. The CLI renders its errors and picks its exit code."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from runner.cli import worker_main
    from runner.launch.rank import leave

    leave(worker_main(sys.argv[1:]))

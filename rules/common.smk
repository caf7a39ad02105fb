# Shared by every rule: the validated config, the corpus file lists, and the code each stage runs.
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
ENGINE = ("model", "device", "tuning", "ops", "params", "engine", "engine_llama", "gpt2", "llama", "dropout")

"""Stage pretrain: train the model from scratch on windows of the encoded text.

Run by Snakemake as `python scripts/pretrain.py SETTINGS_JSON PATHS_JSON LOG` (main's keyword arguments),
under `mpiexec -n N` when pretrain.ranks is N > 1 (each process one rank, clgpt.training.dist)."""

import json
import sys

from clgpt.stage import run_script
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import run_stage


def main(encoded: str, heldout: str, tokenizer: str, model: dict, settings: dict, device: str, checkpoint: str,
         log_csv: str, devices: list | None = None) -> None:
    tok = Tokenizer.load(tokenizer)
    run_stage(
        "pretrain", encoded, settings, checkpoint, log_csv,
        model={**model, "vocab_size": tok.vocab_size}, device=device or None, devices=devices,
        tokenizer_hash=tok.hash(), heldout=heldout,
    )


if __name__ == "__main__":
    run_script(main, sys.argv[3], **json.loads(sys.argv[1]), **json.loads(sys.argv[2]))

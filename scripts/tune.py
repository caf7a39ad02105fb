"""Stage tune: continue from the pretrained checkpoint on User/Assistant dialogs (loss on replies only).

Run by Snakemake as `python scripts/tune.py SETTINGS_JSON PATHS_JSON LOG` (main's keyword arguments),
under `mpiexec -n N` when tune.ranks is N > 1 (each process one rank, clgpt.training.dist)."""

import json
import sys

from clgpt.stage import run_script
from clgpt.training.train import run_stage


def main(pretrained: str, encoded: str, heldout: str, mix: str, settings: dict, device: str, checkpoint: str,
         log_csv: str, devices: list | None = None) -> None:
    run_stage(
        "tune", encoded, settings, checkpoint, log_csv,
        init_ckpt=pretrained, mix_encoded=mix, heldout=heldout, device=device or None, devices=devices,
    )


if __name__ == "__main__":
    run_script(main, sys.argv[3], **json.loads(sys.argv[1]), **json.loads(sys.argv[2]))

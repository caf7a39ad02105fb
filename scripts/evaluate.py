"""Stage evaluate: held-out loss, forgetting, exact-match answers; metrics.json, report.md, plots."""

import os

from clgpt.data import read_dialogs
from clgpt.evaluate import run_evaluate
from clgpt.stage import run_script


def main(inp: dict, tune_dialogs: list, settings: dict, device: str, metrics: str) -> None:
    run_evaluate(
        inp["pretrained"], inp["tuned"], inp["tokenizer"], inp["pretrain_heldout"], inp["tune_heldout"],
        read_dialogs(tune_dialogs), read_dialogs([inp["heldout_dialogs"]]),
        inp["pretrain_log"], inp["tune_log"], settings, os.path.dirname(metrics), device=device or None,
    )


if __name__ == "__main__" and "snakemake" in globals():
    keys = ("pretrained", "tuned", "tokenizer", "pretrain_heldout", "tune_heldout", "heldout_dialogs",
            "pretrain_log", "tune_log")
    run_script(
        main,
        snakemake.log[0],
        inp={k: snakemake.input[k] for k in keys},
        tune_dialogs=list(snakemake.input.tune_dialogs),
        settings=dict(snakemake.params.settings),
        device=snakemake.params.device,
        metrics=snakemake.output.metrics,
    )

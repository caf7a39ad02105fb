"""Stage evaluate: held-out loss (also in nats per byte), forgetting, exact-match answers, sampled
continuations; metrics.json, report.md, plots. Without a tune stage: the pretrained model only."""

import os

from clgpt.data import read_dialogs_split
from clgpt.device.knobs import read as read_knobs
from clgpt.eval.evaluate import run_evaluate
from clgpt.stage import run_script


def main(inp: dict, tune_dialogs: list, corpus: dict, settings: dict, device: str, metrics: str) -> None:
    dialogs, heldout = [], []
    if tune_dialogs:
        dialogs, heldout = read_dialogs_split(tune_dialogs, corpus.get("tune_heldout"), corpus["val_fraction"])
    run_evaluate(
        inp["pretrained"], inp.get("tuned"), inp["tokenizer"], inp["pretrain_heldout"], inp.get("tune_heldout"),
        dialogs, heldout, inp["pretrain_log"], inp.get("tune_log"), settings, os.path.dirname(metrics),
        device=device or None, accept_path=inp.get("accept"), knobs=read_knobs(),  # knobs once, at the stage's edge
    )


if __name__ == "__main__" and "snakemake" in globals():
    keys = ("pretrained", "tuned", "tokenizer", "pretrain_heldout", "tune_heldout", "pretrain_log", "tune_log",
            "accept")
    run_script(
        main,
        snakemake.log[0],
        inp={k: snakemake.input[k] for k in keys if k in snakemake.input.keys()},
        tune_dialogs=list(snakemake.input.get("tune_dialogs", [])),
        corpus=dict(snakemake.params.corpus),
        settings=dict(snakemake.params.settings),
        device=snakemake.params.device,
        metrics=snakemake.output.metrics,
    )

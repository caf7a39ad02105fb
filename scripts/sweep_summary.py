"""Stage sweep_summary: rank the sweep's runs by held-out loss; summary.csv, summary.md, summary.png."""

from clgpt.stage import run_script
from clgpt.training.sweep import summarize


def main(runs: dict, metrics: list, logs: list, csv: str, md: str, png: str) -> None:
    names = list(runs)
    summarize({n: {"overrides": dict(runs[n])} for n in names}, dict(zip(names, metrics)), dict(zip(names, logs)),
              csv, md, png)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        runs=dict(snakemake.params.runs),
        metrics=list(snakemake.input.metrics),
        logs=list(snakemake.input.logs),
        csv=snakemake.output.csv,
        md=snakemake.output.md,
        png=snakemake.output.png,
    )

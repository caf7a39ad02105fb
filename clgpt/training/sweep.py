"""Hyperparameter sweeps: the `sweep:` config section (lists of values per "section.key") becomes one run per
combination, each with its own validated config; stages whose settings no swept key touches are shared by every
run (one tokenizer, one encode when only training settings vary). `summarize` ranks finished runs by held-out loss."""

from __future__ import annotations

import copy
import csv
import io
import itertools
import json
import math
import re

from clgpt.atomic import atomic_path, write_text_atomic
from clgpt.config import load_schema, validate_config
from clgpt.errors import ClgptError

# What each stage reads: config keys ("section" or "section.key") and the stages whose outputs it takes. A stage runs
# once per sweep run when a swept key falls under what it reads or an upstream stage does; else once for all runs.
# Stage names are the folders under results/ (and results/sweep/{name}/).
STAGES = {
    "tokenizer": ({"corpus", "tokenizer"}, ()),
    "encoded": ({"corpus", "model.n_ctx"}, ("tokenizer",)),
    "pretrain": ({"device", "model", "pretrain"}, ("encoded", "tokenizer")),
    "tune": ({"device", "tune"}, ("pretrain", "encoded")),
    "eval": ({"device", "evaluate"}, ("pretrain", "tune", "encoded", "tokenizer")),
}
LABELS = {"tune_heldout_loss": "held-out loss on tune dialogs", "pretrain_heldout_loss": "held-out loss on pretrain text"}
NOT_SWEPT = {"sweep", "resources", "device", "corpus"}  # where and how runs go, and the data all runs share
# how a stage is launched is fixed per rule (its MPI ranks are its `resources:`), the same for every run
NOT_SWEPT_KEYS = {"pretrain.ranks", "tune.ranks"}


def sweep_keys(schema: dict | None = None) -> list[str]:
    """Every "section.key" a sweep may vary: the settings of the stage sections in the schema, and
    "section.group.key" for the keys of a settings group (pretrain.muon.lr)."""
    schema = schema or load_schema()
    keys = []
    for section, sub in schema["properties"].items():
        if section not in NOT_SWEPT and sub.get("type") == "object":
            for k, spec in sub.get("properties", {}).items():
                if f"{section}.{k}" not in NOT_SWEPT_KEYS:
                    keys.append(f"{section}.{k}")
                    if spec.get("type") == "object":
                        keys += [f"{section}.{k}.{kk}" for kk in spec.get("properties", {})]
    return keys


def _in_schema(key: str) -> bool:
    """Whether "section.key" (or a top-level key) is a setting of the config at all."""
    schema = load_schema()["properties"]
    section, _, sub = key.partition(".")
    return section in schema and (not sub or sub in schema[section].get("properties", {}))


def check_sweep(sweep: dict, source: str = "config.yaml") -> None:
    """One-line errors for an unknown "section.key" or a value list that is empty or not a list."""
    allowed = sweep_keys()
    for key, values in sweep.items():
        if key not in allowed and _in_schema(key):
            raise ClgptError(f"{source}: sweep.{key} cannot be swept: every run of a sweep shares it (how a stage is "
                             f"launched, where the data is); set it outside sweep: and sweep other keys")
        if key not in allowed:
            section = key.split(".")[0]
            near = [k for k in allowed if k.startswith(section + ".")] or allowed
            raise ClgptError(f"{source}: unknown sweep key 'sweep.{key}'; sweep keys are section.key, "
                             f"e.g. {', '.join(near[:6])}")
        if not isinstance(values, list):
            raise ClgptError(f"{source}: sweep.{key} must be a list of values, e.g. [{values!r}]")
        if not values:
            raise ClgptError(f"{source}: sweep.{key} is an empty list; give at least one value or remove the key")


def _value_name(value) -> str:
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text) or "empty"


def run_name(overrides: dict) -> str:
    """`lr-0.001_n_layer-1` for {"pretrain.lr": 0.001, "model.n_layer": 1}: the key without its section unless two
    swept keys share that name (pretrain.lr and tune.lr)."""
    short = [k.split(".", 1)[1] for k in overrides]
    parts = []
    for key, value in overrides.items():
        label = key.split(".", 1)[1]
        parts.append(f"{key if short.count(label) > 1 else label}-{_value_name(value)}")
    return "_".join(parts)


def sweep_runs(config: dict, source: str = "config.yaml") -> dict[str, dict]:
    """{run name: {"overrides": {key: value}, "config": the run's validated config}}, one per combination of the
    sweep lists in the order the config gives them; {} when there is no sweep."""
    sweep = config.get("sweep") or {}
    check_sweep(sweep, source)
    runs = {}
    for combo in itertools.product(*sweep.values()):
        overrides = dict(zip(sweep, combo))
        name = run_name(overrides)
        if name in runs:
            raise ClgptError(f"{source}: sweep runs {runs[name]['overrides']} and {overrides} get the same name "
                             f"'{name}'; make the values distinct")
        run = copy.deepcopy(config)
        run["sweep"] = {}
        for key, value in overrides.items():
            section, k = key.split(".", 1)
            group, _, sub = k.partition(".")
            if sub:  # a key of a settings group (pretrain.muon.lr)
                run[section][group] = {**(run[section].get(group) or {}), sub: value}
            else:
                run[section][k] = value
        runs[name] = {"overrides": overrides, "config": validate_config(run, source=f"{source} (sweep run {name})")}
    return runs


def varied_stages(sweep: dict) -> set[str]:
    """Stages that run once per sweep run (the rest run once, at their usual results/ path)."""
    varied: set[str] = set()
    for stage, (reads, upstream) in STAGES.items():  # in pipeline order, so upstream is decided first
        touched = any(k in reads or k.split(".")[0] in reads for k in sweep)
        if touched or varied.intersection(upstream):
            varied.add(stage)
    return varied


def stage_dir(stage: str, name: str, varied: set[str]) -> str:
    return f"results/sweep/{name}/{stage}" if stage in varied else f"results/{stage}"


def _final_losses(metrics: dict) -> dict:
    """Held-out losses of the model each run ships (the tuned one, or the pretrained one without tuning)."""
    heldout = metrics.get("heldout", {})
    out = {}
    for part in ("tune", "pretrain"):
        losses = heldout.get(part, {})
        final = losses.get("loss_tuned", losses.get("loss_pretrained"))
        out[f"{part}_heldout_loss"] = final if final is not None and math.isfinite(final) else None
    return out


def summarize(runs: dict[str, dict], metrics_paths: dict[str, str], log_paths: dict[str, str],
              csv_path: str, md_path: str, png_path: str) -> list[dict]:
    """Rank the runs by held-out loss (tune held-out of the shipped model; pretrain held-out where there is no tune
    loss), best first; write the table as CSV and Markdown and plot the losses. Returns the rows."""
    import pandas as pd

    if not runs:
        raise ClgptError("config.yaml has no sweep: section; add lists of values, e.g. sweep: {pretrain.lr: [0.001, 0.003]}")
    rows = []
    for name, run in runs.items():
        with open(metrics_paths[name], encoding="utf-8") as f:
            metrics = json.load(f)
        exact = metrics.get("exact_match", {})
        row = {"run": name, **run["overrides"], **_final_losses(metrics),
               "tune_exact_match": exact.get("tune", {}).get("rate"),
               "heldout_exact_match": exact.get("heldout", {}).get("rate"),
               "num_params": metrics.get("num_params")}
        rows.append(row)
    rank_key = "tune_heldout_loss" if all(r["tune_heldout_loss"] is not None for r in rows) else "pretrain_heldout_loss"
    rows.sort(key=lambda r: (r[rank_key] is None, r[rank_key] if r[rank_key] is not None else 0.0, r["run"]))
    for i, row in enumerate(rows):
        row["rank"] = i + 1
    columns = ["rank", "run", *next(iter(runs.values()))["overrides"], "tune_heldout_loss", "pretrain_heldout_loss",
               "tune_exact_match", "heldout_exact_match", "num_params"]

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(csv_path, buf.getvalue())

    measured = {"tune_heldout_loss", "pretrain_heldout_loss", "tune_exact_match", "heldout_exact_match"}

    def cell(column, v):  # swept values as the config gives them, measurements to 4 places
        return "" if v is None else f"{v:.4f}" if column in measured else str(v)

    md = [f"# Sweep: {len(rows)} runs ranked by {LABELS[rank_key]} (nats/token, lower is better)", "",
          "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    md += ["| " + " | ".join(cell(c, r.get(c)) for c in columns) + " |" for r in rows]
    md += ["", f"Best: `{rows[0]['run']}` -> `models/{rows[0]['run']}.gguf`", ""]
    write_text_atomic(md_path, "\n".join(md))

    logs = {name: pd.read_csv(path) for name, path in log_paths.items()}
    _plot(rows, rank_key, logs, png_path)
    return rows


def _plot(rows: list[dict], rank_key: str, logs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 0.9 + max(3.0, 0.35 * len(rows))))
    shown = set()
    for row in rows:  # best first, so the legend reads as the ranking
        log = logs.get(row["run"])
        if log is None or not len(log) or id(log) in shown:
            continue
        shown.add(id(log))
        smooth = log["loss"].ewm(alpha=0.1, adjust=False).mean()
        curves.plot(log["step"], smooth, lw=1.2, label=f"{row['rank']}. {row['run']}")
    curves.set_xlabel("pretrain step")
    curves.set_ylabel("training loss, smoothed (nats/token)")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    names = [f"{r['rank']}. {r['run']}" for r in rows][::-1]
    values = [r[rank_key] if r[rank_key] is not None else float("nan") for r in rows][::-1]
    bars.barh(names, values, color=["C2" if n.startswith("1. ") else "C0" for n in names])
    finite = [v for v in values if math.isfinite(v)]
    if finite:  # zoom on the spread: runs often differ by a few hundredths of a nat
        low, high = min(finite), max(finite)
        pad = max(high - low, 0.01 * high)
        bars.set_xlim(low - pad, high + 0.6 * pad)
    for y, v in enumerate(values):
        if math.isfinite(v):
            bars.text(v, y, f" {v:.4f}", va="center", fontsize=8)
    bars.set_xlabel(LABELS[rank_key] + " (nats/token, lower is better)")
    bars.tick_params(axis="y", labelsize=8)
    bars.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)

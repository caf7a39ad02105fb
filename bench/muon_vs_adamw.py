"""AdamW against Muon on one recipe, the rest unchanged: held-out loss against wall time, and the time Muon needs
to reach the best held-out loss AdamW reaches in its full run.

    python bench/muon_vs_adamw.py [--configfile configs/shakespeare_char_cpu.yaml] [--seeds 3] [--steps N]
                                  [--eval-every 100] [--muon-lr 0.02] [--out bench/data/muon_cpu]

Run in the repository root with the recipe's text in its corpus folder (text/ for the character recipes: see
bench/austen_text.py). The pipeline encodes the text once (snakemake, the recipe's tokenizer and held-out split);
then each run is the pretrain stage (clgpt.training.train.run_stage, what scripts/pretrain.py calls) in a process
of its own, optimizers alternated (adamw, muon, adamw, muon, ...) with seeds seed, seed+1, ...; --steps and
--eval-every replace the recipe's (the same for both). Every step's wall and process CPU time are recorded beside
the log's held-out losses.

Writes the runs' checkpoints and logs under --runs (a temporary folder unless given), OUT/runs.csv (optimizer,
seed, step, wall_s, cpu_s, val_loss at every evaluation), OUT/heldout.png (held-out
loss against wall time) and prints the summary: the target = median over seeds (the upper one of an even count,
so most AdamW runs reach it) of AdamW's best held-out loss;
each run's wall time to first reach it (linear between evaluations; none if it never does); the medians and
muon / adamw. On the GPU recipe: --configfile configs/shakespeare_char_gpu.yaml (the device from the config); where
a call has a time limit, --budget-s stops before a seed's pair that would end past it (the longest pair so far
taken as its length; runs.csv is written after every pair), and one seed a later call (--seeds 1 --first-seed S
--out DIR_S) adds the rest: --summarize DIR_*/runs.csv. Each run also prints its median ms a step.
Encoded files already in results/ are used only if their vocabulary and held-out fraction are the recipe's.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(args) -> None:
    """The child: one pretrain stage; OUT/<opt>-<seed>/steps.csv gets every step's wall and CPU time."""
    sys.path.insert(0, str(ROOT))
    from clgpt.text.tokenizer import Tokenizer
    from clgpt.training.train import run_stage

    spec = json.loads(args.one)
    out = Path(spec["dir"])
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.load(spec["tokenizer"])
    times = []
    t0, c0 = time.perf_counter(), time.process_time()

    def callback(step, loss):
        times.append((step, time.perf_counter() - t0, time.process_time() - c0))

    run_stage("pretrain", spec["encoded"], spec["settings"], str(out / "model.ckpt"), str(out / "log.csv"),
              model={**spec["model"], "vocab_size": tok.vocab_size}, device=spec["device"] or None,
              tokenizer_hash=tok.hash(), heldout=spec["heldout"], callback=callback)
    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "wall_s", "cpu_s"])
        w.writerows([s, f"{a:.4f}", f"{b:.4f}"] for s, a, b in times)


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """First wall time at which the held-out loss reaches target, linear between evaluations."""
    prev = None
    for t, v in points:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            return prev[0] + (t - prev[0]) * (prev[1] - target) / (prev[1] - v)
        prev = (t, v)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", default="configs/shakespeare_char_cpu.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=-1, help="the first run's seed (default: the recipe's)")
    ap.add_argument("--summarize", nargs="+", metavar="CSV", help="only the summary and plot of runs.csv files "
                    "(e.g. one seed a device call), into --out")
    ap.add_argument("--steps", type=int, default=0, help="replace the recipe's steps (0: keep)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--muon-lr", type=float, default=0.0, help="muon.lr (0: the schema's default)")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--precision", default="", help="replace the recipe's pretrain.precision (fp32|tf32|bf16|auto)")
    ap.add_argument("--out", default="bench/data/muon_cpu")
    ap.add_argument("--runs", default="", help="folder of the runs' checkpoints and logs (default: a temporary one)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no seed's pair that would end later than "
                    "this many seconds from the start (0: no limit)")
    ap.add_argument("--warm", action="store_true", help="first a 2-step run of AdamW and of Muon, untimed, so that "
                    "no timed run pays the kernels' builds (the first run of a call would otherwise)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one_run(args)
        return
    if args.summarize:
        rows = []
        for path in args.summarize:
            with open(path, newline="") as f:
                rows += [{**r, "seed": int(r["seed"]), "step": int(r["step"]),
                          **{k: float(r[k]) for k in ("wall_s", "cpu_s", "val_loss")}} for r in csv.DictReader(f)]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        summarize(rows, args.optimizers.split(","), Path(args.out))
        return
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    from clgpt.config import load_workflow_config

    cfg = load_workflow_config("config.yaml", [args.configfile])
    targets = ["results/encoded/pretrain.bin", "results/encoded/pretrain_heldout.bin",
               "results/tokenizer/tokenizer.json"]
    if not all(Path(t).exists() for t in targets):  # made on the CPU beforehand where no snakemake is installed
        subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", *targets, "--configfile", args.configfile],
                       check=True)
    meta = json.loads(Path(targets[0]).with_suffix(".json").read_text())
    want = (cfg["tokenizer"]["vocab_size"], cfg["corpus"]["val_fraction"])
    if (meta["vocab_size"], meta["split"]["val_fraction"]) != want:
        raise SystemExit(f"{targets[0]}: vocabulary {meta['vocab_size']}, held-out fraction "
                         f"{meta['split']['val_fraction']}, made under another config than {args.configfile} "
                         f"({want[0]}, {want[1]}): remove results/encoded and results/tokenizer, or make them with "
                         f"snakemake --configfile {args.configfile}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = copy.deepcopy(cfg["pretrain"])
    if args.steps:
        base["steps"] = args.steps
    base["eval_every"] = args.eval_every
    if args.precision:
        base["precision"] = args.precision
    base["checkpoint_every"] = max(base["checkpoint_every"], base["steps"])  # no saves mid-run inside the timing
    opts = args.optimizers.split(",")
    runs_dir = Path(args.runs or tempfile.mkdtemp(prefix="muon_vs_adamw_"))

    def child(d: Path, settings: dict) -> None:
        """One pretrain stage with `settings` in a process of its own (one_run), its files under d."""
        spec = {"dir": str(d), "settings": settings, "model": cfg["model"], "device": cfg["device"],
                "encoded": targets[0], "heldout": targets[1], "tokenizer": targets[2]}
        subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], check=True)

    if args.warm:
        for opt in ("adamw", "muon"):
            t = time.perf_counter()
            child(runs_dir / f"warm-{opt}", dict(base, steps=2, eval_every=1, checkpoint_every=2, optimizer=opt,
                                                 eval_tokens=base["batch_size"] * base["seq_len"]))
            print(f"warm {opt}: {time.perf_counter() - t:.1f} s", flush=True)
    rows, start, longest = [], time.perf_counter(), 0.0
    for k in range(args.seeds):
        t_pair = time.perf_counter()
        if args.budget_s and rows and t_pair - start + longest > args.budget_s:
            print(f"stopping after {k} of {args.seeds} seeds: another pair ({longest:.0f} s) would end past the "
                  f"budget of {args.budget_s:.0f} s", flush=True)
            break
        for opt in opts:
            s = dict(base, seed=(base["seed"] if args.first_seed < 0 else args.first_seed) + k, optimizer=opt)
            if opt == "muon" and args.muon_lr:
                s["muon"] = dict(s.get("muon", {}), lr=args.muon_lr)
            d = runs_dir / f"{opt}-{s['seed']}"
            for name in ("model.ckpt", "log.csv", "model.ckpt.best"):
                (d / name).unlink(missing_ok=True)
            t = time.perf_counter()
            child(d, s)
            with open(d / "steps.csv", newline="") as f:
                times = {int(r["step"]): r for r in csv.DictReader(f)}
            walls = [float(times[st]["wall_s"]) for st in sorted(times)]
            step_ms = statistics.median(b - a for a, b in zip(walls, walls[1:])) * 1e3 if len(walls) > 1 else 0.0
            print(f"{opt} seed {s['seed']}: {time.perf_counter() - t:.1f} s, {step_ms:.1f} ms a step (median)",
                  flush=True)
            with open(d / "log.csv", newline="") as f:
                for r in csv.DictReader(f):
                    if r["val_loss"]:
                        st = times[int(r["step"])]
                        rows.append({"optimizer": opt, "seed": s["seed"], "step": int(r["step"]),
                                     "wall_s": float(st["wall_s"]), "cpu_s": float(st["cpu_s"]),
                                     "val_loss": float(r["val_loss"])})
        longest = max(longest, time.perf_counter() - t_pair)
        with open(out / "runs.csv", "w", newline="") as f:  # after every pair: a call cut short keeps what ran
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if rows:  # --seeds 0 --warm only builds the kernels
        summarize(rows, opts, out)


def summarize(rows: list[dict], opts: list[str], out: Path) -> None:
    runs = {}
    for r in rows:
        runs.setdefault((r["optimizer"], r["seed"]), []).append(r)
    best = {key: min(x["val_loss"] for x in pts) for key, pts in runs.items()}
    target = statistics.median_high(v for (o, _), v in best.items() if o == opts[0])
    print(f"target: the median best held-out loss of {opts[0]}, {target:.4f}")
    med = {}
    for opt in opts:
        for clock in ("wall_s", "cpu_s"):
            ts = [time_to([(x[clock], x["val_loss"]) for x in pts], target) for (o, _), pts in sorted(runs.items())
                  if o == opt]
            ok = [t for t in ts if t is not None]
            med[opt, clock] = statistics.median(ok) if len(ok) * 2 > len(ts) else None
            print(f"{opt}: best held-out {[round(best[k], 4) for k in sorted(best) if k[0] == opt]}, "
                  f"{clock} to the target {[None if t is None else round(t, 1) for t in ts]}, median {med[opt, clock]}")
    for clock in ("wall_s", "cpu_s"):
        a, b = med[opts[0], clock], med[opts[-1], clock]
        print(f"{opts[-1]} / {opts[0]} {clock} to the target: {b / a:.3f}" if a and b else
              f"{opts[-1]} does not reach the target in most runs ({clock})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {opt: c for opt, c in zip(opts, ("tab:blue", "tab:red", "tab:green"))}
    for (opt, seed), pts in sorted(runs.items()):
        ax.plot([x["wall_s"] for x in pts], [x["val_loss"] for x in pts], color=colors[opt], alpha=0.8,
                label=opt if seed == min(s for o, s in runs if o == opt) else None, marker=".")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"{opts[0]}'s best (median) {target:.3f}")
    ax.set_xlabel("wall time, s")
    ax.set_ylabel("held-out loss, nats/token")
    lo = min(x["val_loss"] for x in rows)
    ax.set_ylim(lo - 0.05, lo + 1.0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=110)


if __name__ == "__main__":
    main()

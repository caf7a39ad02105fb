"""Muon's step overhead: a training step with AdamW against the same step with Muon on a recipe's model, in
alternated pairs (adamw, muon, adamw, muon, ...), and the optimizer's part of each (clip + AdamW, or clip + Muon
for the block matrices + AdamW for the rest) timed alone.

    python bench/muon_step.py [--configfile configs/shakespeare_char_gpu.yaml] [--pairs 5] [--steps 20]
                              [--precision auto] [--device SPEC] [--ns-steps 5] [--profile]

The model, batch, context, dropout and precision are the recipe's (config.yaml under --configfile; vocabulary
from its tokenizer.vocab_size), on random tokens. Each round of a pair trains --steps steps after the engine's
warmup; `step ms` is the whole step (forward, backward, optimizer) over the round, `opt ms` the median of the
optimizer call alone (the queue finished before it; it ends on its blocking read of the grad norm). Prints one
line a round and the medians over pairs with muon / adamw; `--json FILE` writes them too.
Also prints the Muon step's kernel launches, counted once, beside the number of block matrices and of their shapes.
--profile then times each optimizer call's kernels on a profiling queue (a second engine of each optimizer, warmed
up, PROFILE_CALLS calls averaged, the queue finished before each): the call's wall time, its kernels' device time
and launches, and the device time of each kernel (matmuls by form and M x N x K), largest first. --pairs 0 with
--profile prints the profile alone. --check first orthogonalises CHECK_COUNT random matrices of each of the recipe's
block shapes on the device, all shapes in one call as a step does, against float64 (clgpt.models.reference's
newton_schulz), and stops unless each is within the precision's tolerance (tests/test_muon.py's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
PROFILE_CALLS = 5
CHECK_COUNT = 3
CHECK_TOL = {"fp32": 2e-5, "tf32": 6e-3, "bf16": 4e-2}  # absolute, on entries of magnitude up to about 1
PROFILE_ROWS = 25


def count_launches(eng, step) -> int:
    """Kernel launches enqueued while step() runs (every launch goes through the ops' launcher)."""
    launcher, n = eng.ops.launcher, [0]
    saved = {name: getattr(launcher, name) for name in ("launch", "launch_plain", "launch_set")}

    def counting(fn):
        def wrapped(*a, **k):
            n[0] += 1
            return fn(*a, **k)
        return wrapped

    for name, fn in saved.items():
        setattr(launcher, name, counting(fn))
    try:
        step()
    finally:
        for name in saved:
            delattr(launcher, name)  # back to the class's methods
    return n[0]


def profile_optimizer(make, fwd_bwd, opt_step, pdev) -> tuple[list[str], dict]:
    """-> (report lines, figures) of PROFILE_CALLS optimizer calls of each optimizer on the profiling device pdev
    (clgpt.bench's: it logs (label, event) of every launch). make(opt, dev) -> an engine on dev."""
    from collections import defaultdict

    lines, figures = [], {}
    for opt in ("muon", "adamw"):
        eng = make(opt, pdev)
        for i in range(WARMUP):
            fwd_bwd(eng, i)
            opt_step(opt, eng)
        pdev.queue.finish()
        tot, cnt, wall = defaultdict(float), defaultdict(int), 0.0
        for i in range(PROFILE_CALLS):
            fwd_bwd(eng, WARMUP + i)
            pdev.queue.finish()
            pdev.log.clear()
            t = time.perf_counter()
            opt_step(opt, eng)
            pdev.queue.finish()
            wall += time.perf_counter() - t
            for label, ev in pdev.log:
                tot[label] += (ev.profile.end - ev.profile.start) * 1e-9 / PROFILE_CALLS
                cnt[label] += 1
        kernels = sum(tot.values())
        launches = sum(cnt.values()) // PROFILE_CALLS
        figures[opt] = {"wall_ms": wall / PROFILE_CALLS * 1e3, "kernels_ms": kernels * 1e3, "launches": launches,
                        "kernel_ms": {k: v * 1e3 for k, v in tot.items()}}
        lines.append(f"profile {opt}: optimizer call wall {wall / PROFILE_CALLS * 1e3:.2f} ms (profiling queue), "
                     f"kernels {kernels * 1e3:.3f} ms in {launches} launches ({PROFILE_CALLS} calls averaged)")
        for k in sorted(tot, key=tot.get, reverse=True)[:PROFILE_ROWS]:
            lines.append(f"  {tot[k] * 1e3:8.3f} ms  {cnt[k] // PROFILE_CALLS:4d}x  {k}")
        del eng
    return lines, figures


def check_newton_schulz(ops, shapes) -> list[str]:
    """Newton-Schulz of CHECK_COUNT random matrices of each (rows, cols) in `shapes` through clgpt.ops.muon on
    ops' device (one orthogonalized call for all) against float64 -> report lines; SystemExit when off."""
    import pyopencl as cl

    from clgpt.models import reference as ref
    from clgpt.ops.muon import Muon

    rng = np.random.default_rng(1)
    offs, n0 = {}, 0
    for rows, cols in sorted(shapes):
        offs[rows, cols] = [n0 + g * (rows * cols + 64) for g in range(CHECK_COUNT)]
        n0 += CHECK_COUNT * (rows * cols + 64)
    u = rng.normal(0, 0.02, n0).astype(np.float32)
    U = cl.Buffer(ops.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=u)
    mu, tol, lines, bad = Muon(ops), CHECK_TOL[ops.precision], [], []
    for (rows, cols), o, X in mu.orthogonalized(U, offs, 5):
        ld = mu.stack_stride(rows, cols)
        got = np.empty(len(o) * ld, np.float32)
        cl.enqueue_copy(ops.queue, got, X, is_blocking=True)
        err = max(float(np.abs(got[g * ld: g * ld + rows * cols].reshape(rows, cols)
                              - ref.newton_schulz(u[off: off + rows * cols].reshape(rows, cols))).max())
                  for g, off in enumerate(o))
        lines.append(f"check {rows}x{cols} x{len(o)}: max |NS - float64| {err:.2e} (tolerance {tol:.0e}, "
                     f"{ops.precision})")
        if not err <= tol:
            bad.append(f"{rows}x{cols}")
    if bad:
        raise SystemExit("\n".join(lines) + f"\ncheck failed: {', '.join(bad)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", default="configs/shakespeare_char_gpu.yaml")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps a round")
    ap.add_argument("--precision", default="", help="replace the recipe's pretrain.precision")
    ap.add_argument("--device", default="", help="replace the recipe's device")
    ap.add_argument("--ns-steps", type=int, default=-1, help="replace muon.ns_steps (-1: keep)")
    ap.add_argument("--batch-size", type=int, default=0, help="replace the batch (0: keep; a small one checks "
                    "a GPU recipe's script on a CPU)")
    ap.add_argument("--check", action="store_true", help="first Newton-Schulz on the device against float64")
    ap.add_argument("--profile", action="store_true", help="then each optimizer call's kernels on a profiling "
                    "queue")
    ap.add_argument("--json", default="", help="write the rounds and medians here")
    args = ap.parse_args()
    try:
        import clgpt  # noqa: F401  (the PYTHONPATH's, else this checkout's)
    except ImportError:
        sys.path.insert(0, str(ROOT))
    from clgpt.config import load_workflow_config
    from clgpt.device.opencl import get_device
    from clgpt.model import ModelConfig, init_params, muon_matrices, num_params
    from clgpt.device import knobs as knobs_mod
    from clgpt.models.factory import make_engine

    cfg_all = load_workflow_config(str(ROOT / "config.yaml"), [args.configfile])
    s = cfg_all["pretrain"]
    mu = dict(s["muon"])
    if args.ns_steps >= 0:
        mu["ns_steps"] = args.ns_steps
    cfg = ModelConfig(**{**cfg_all["model"], "vocab_size": cfg_all["tokenizer"]["vocab_size"]})
    B, T = args.batch_size or s["batch_size"], s["seq_len"]
    dev = get_device(args.device or cfg_all["device"] or None)
    precision = args.precision or s.get("precision", "auto")
    mats = muon_matrices(cfg)
    shapes = {(r, c) for _, r, c in mats.values()}
    print(f"device: {dev.name}; model {cfg.arch} L={cfg.n_layer} C={cfg.n_embd} F={cfg.n_ff} V={cfg.vocab_size}, "
          f"{num_params(cfg):,} parameters, B={B} T={T}, precision {precision}; Muon: "
          f"{sum(n for n, _, _ in mats.values())} matrices of {len(shapes)} shapes, {mu['ns_steps']} NS steps",
          flush=True)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
                rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)) for _ in range(8)]
    kn = knobs_mod.read()  # once, at the bench's edge

    def make(opt, device):
        return make_engine(cfg, init_params(cfg, 0), batch_size=B, seq_len=T, device=device,
                           dropout=float(s.get("dropout", 0.0)), precision=precision, muon=opt == "muon", knobs=kn)

    engines = {opt: make(opt, dev) for opt in ("adamw", "muon")}
    if args.check:
        print("\n".join(check_newton_schulz(engines["muon"].ops, shapes)), flush=True)
    settings = {"adamw": None, "muon": mu}  # the peak learning rates (no schedule: the step costs the same)
    lr = float(s["lr"])

    def fwd_bwd(eng, i):
        tok, tgt = batches[i % len(batches)]
        eng.zero_grad()
        loss = eng.forward(tok, tgt, **({"dropout_seed": i} if s.get("dropout") else {}))
        eng.backward()
        return loss

    def opt_step(opt, eng=None):
        return (eng or engines[opt]).step(lr, s["beta1"], s["beta2"], 1e-8, s["weight_decay"], s["grad_clip"],
                                 settings[opt])

    for opt, eng in engines.items():
        for i in range(WARMUP):
            fwd_bwd(eng, i)
            opt_step(opt)
        eng.queue.finish()
    fwd_bwd(engines["muon"], 0)
    engines["muon"].queue.finish()
    launches = count_launches(engines["muon"], lambda: opt_step("muon"))
    fwd_bwd(engines["adamw"], 0)
    engines["adamw"].queue.finish()
    adamw_launches = count_launches(engines["adamw"], lambda: opt_step("adamw"))
    print(f"launches an optimizer step: adamw {adamw_launches}, muon {launches}", flush=True)

    rounds = []
    for p in range(args.pairs):
        for opt, eng in engines.items():
            opt_ms = []
            eng.queue.finish()
            t0 = time.perf_counter()
            for i in range(args.steps):
                loss = fwd_bwd(eng, WARMUP + i)
                eng.queue.finish()
                t = time.perf_counter()
                opt_step(opt)
                opt_ms.append((time.perf_counter() - t) * 1e3)
            eng.queue.finish()
            step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
            if not np.isfinite(loss):
                raise SystemExit(f"{opt}: the loss is {loss}")
            r = {"pair": p, "optimizer": opt, "step_ms": step_ms, "opt_ms": statistics.median(opt_ms)}
            rounds.append(r)
            print(f"pair {p} {opt:5s}: step {step_ms:8.2f} ms, opt {r['opt_ms']:8.2f} ms", flush=True)
    med = {}
    if rounds:
        med = {(opt, k): statistics.median(r[k] for r in rounds if r["optimizer"] == opt)
               for opt in engines for k in ("step_ms", "opt_ms")}
        for k in ("step_ms", "opt_ms"):
            a, m = med["adamw", k], med["muon", k]
            print(f"median {k[:-3]} ms: adamw {a:.2f}, muon {m:.2f}, muon / adamw {m / a:.3f}, "
                  f"muon - adamw {m - a:.2f}")
    prof = {}
    if args.profile:
        from clgpt.bench import _profiling_device
        engines.clear()  # the timed engines' buffers go before the profiled ones are made
        lines, prof = profile_optimizer(make, fwd_bwd, opt_step, _profiling_device(dev))
        print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev.name, "precision": precision, "launches":
                                               {"adamw": adamw_launches, "muon": launches}, "rounds": rounds,
                                               "medians": {f"{o} {k}": v for (o, k), v in med.items()},
                                               "profile": prof}, indent=1))


if __name__ == "__main__":
    main()

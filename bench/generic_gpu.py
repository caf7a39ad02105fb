"""The generic GPU path (CLGPT_LAUNCH=gpu: nothing NVIDIA-specific) with the device tuner's own choices, against
PyTorch CUDA eager fp32 (TF32 off, SDPA, fused AdamW), in one run:

    python3 bench/generic_gpu.py [--shapes M6 L] [--reps 2] [--gemm 4096]      (bash bench/gpu.sh generic)

(a) the tuner's first run at each shape (`clgpt tune-device` on an empty cache: its own total and the command's
    wall time, startup and builds included), written to a tuning file the runs below pin;
(b) training tokens/s, fp32, alternated per shape: clgpt tuned, PyTorch eager, (d) clgpt on the untuned generic
    row (`--tuning off`, first round only), with the ratios to PyTorch;
(c) the GEMM alone at --gemm^2 fp32 (C = A @ B): the tuner's pick for that product and the untuned generic row,
    timed through the tuner's launches, against torch.matmul (TF32 off), alternated.
--tiny runs the same steps on a CPU in a few minutes (PoCL, PyTorch on the CPU, a one-layer model, two candidate
tiles): a check of this script, not a figure.

    python3 bench/generic_gpu.py --bf16 [--shapes L] [--reps 3]               (bash bench/gpu.sh generic-bf16)

bf16 storage on the generic row instead (kernels/matmul.cl A16, B16: the products on bf16 copies of their operands):
(a) as above, with the tuner's own fp32 / bf16-storage pair and what `precision: auto` makes of it; (e) training
tokens/s alternated per shape, fp32 then bf16 on the same tuning file, and their ratio; (f) the GEMM alone at
--gemm^2 on the tuner's pick, fp32 then bf16 storage (the two copies' making included), alternated.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # bench/gpu_env.sh's
    "M6": "--vocab 4096 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64",
    "L": "--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16",
    "T": "--vocab 96 --ctx 32 --embd 32 --ffn 64 --heads 2 --layers 1 --batch 2",  # --tiny
}
STEPS = {"M6": 20, "L": 8, "T": 3}


def run(cmd: list[str], env: dict, timeout: int) -> tuple[str, float]:
    """-> (stdout + stderr, wall seconds) of cmd; the output's tail printed and an exit where it fails."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    wall = time.perf_counter() - t0
    out = p.stdout + p.stderr
    if p.returncode:
        print(f"FAILED ({p.returncode}): {' '.join(cmd)}\n{out[-3000:]}", flush=True)
        sys.exit(1)
    return out, wall


def figure(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if not m:
        print(f"no {pattern!r} in:\n{text[-2000:]}", flush=True)
        sys.exit(1)
    return float(m.group(1))


def gemm_only(args) -> None:
    """(c) in this process: the tuner's pick for the n^2 product and the generic row, GFLOP/s each (best of reps)."""
    sys.path.insert(0, str(ROOT))
    from clgpt.device import tuner, tuning
    from clgpt.device.opencl import get_device

    dev = get_device(args.device)
    n = args.gemm
    prod = (n, n, n, 0, 0)
    cands = tuner.candidates(tuner.Limits.of(dev.device))[: args.max_candidates or None]
    rec = tuner.tune(dev, [(prod, 1)], cands=cands, progress=False)
    pick = rec["candidates"][rec["products"][0]["tiles"]]
    bench = tuner._Bench(dev, [prod])
    generic = dict(tuning._GPU)
    sides = [("tuned", pick, "fp32"), ("tuned", tuner.stored16(pick), "bf16-storage")] if args.bf16 else \
        [("generic", generic, "fp32"), ("tuned", pick, "fp32")]
    for name, mm, how in sides:
        assert bench.check(mm, 0, 0, 1) == "", f"{name} {how} tiles disagree with float64"
    best = [float("inf")] * len(sides)
    for _ in range(args.gemm_reps):  # alternated: one timed run of each side a round, the best kept
        for j, (name, mm, how) in enumerate(sides):
            best[j] = min(best[j], bench.time(mm, prod, 1, reps=1))
    for (name, mm, how), t in zip(sides, best):
        print(f"gemm {name} {n}^2 {how} {tuner._describe_tiles(mm)}: {2 * n**3 / t / 1e9:.1f} GFLOP/s", flush=True)
    print(f"gemm tuning took {rec['seconds']:.1f} s", flush=True)


def storage(args, env, files, dev, limit) -> int:
    """--bf16: (e) training fp32 against bf16 storage on the tuner's file, alternated; (f) the GEMM alone."""
    py = sys.executable
    results = {s: {"fp32": [], "bf16": []} for s in args.shapes}
    print("== (e) training on the generic row, tuned, alternated: fp32, bf16 storage", flush=True)
    for r in range(args.reps):
        for s in args.shapes:
            sa, steps = SHAPES[s].split(), str(STEPS[s])
            for prec in ("fp32", "bf16"):
                out, wall = run([py, "-m", "clgpt", "bench", *sa, "--steps", steps, "--gemm", "0", "--precision", prec,
                                 "--tuning", files[s], *dev], env, 240)
                results[s][prec].append(figure(r"tokens/s=([\d.]+)", out))
                print(f"round {r + 1} {s} {prec}: {results[s][prec][-1]:,.0f} tokens/s ({wall:.0f} s)", flush=True)
    print(f"== (f) GEMM {args.gemm}^2 on the tuner's pick, alternated: fp32, bf16 storage (copies included)", flush=True)
    gemm = {"fp32": [], "bf16-storage": []}
    for r in range(args.reps):
        out, _ = run([py, "bench/generic_gpu.py", "--gemm-only", "--bf16", "--gemm", str(args.gemm), "--gemm-reps",
                      str(args.gemm_reps), *dev, *limit], env, 240)
        for side in gemm:
            gemm[side].append(figure(rf"gemm tuned \d+\^2 {side} [^:]*: ([\d.]+) GFLOP/s", out))
        print(out.strip(), flush=True)
    print("== summary (medians; goal: bf16 storage at L >= 1.3x the generic row's fp32)")
    for s in args.shapes:
        f, b = (statistics.median(results[s][k]) for k in ("fp32", "bf16"))
        print(f"{s}: fp32 {f:,.0f} tokens/s, bf16 storage {b:,.0f} ({b / f:.2f}x)")
    f, b = (statistics.median(gemm[k]) for k in ("fp32", "bf16-storage"))
    print(f"GEMM {args.gemm}^2: fp32 {f:,.0f} GFLOP/s, bf16 storage {b:,.0f} ({b / f:.2f}x)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["M6", "L"], choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=2, help="alternated rounds of clgpt tuned / PyTorch")
    ap.add_argument("--gemm", type=int, default=4096)
    ap.add_argument("--gemm-reps", type=int, default=10)
    ap.add_argument("--device", default=None, help="the OpenCL device (default: clgpt's choice)")
    ap.add_argument("--torch-device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--max-candidates", type=int, default=0, help="tune among the first N candidates (0: all)")
    ap.add_argument("--tiny", action="store_true", help="a CPU check of this script: shape T, PoCL, torch on CPU")
    ap.add_argument("--bf16", action="store_true", help="fp32 against bf16 storage on the generic row (e, f)")
    ap.add_argument("--gemm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.shapes, args.gemm, args.gemm_reps, args.reps = ["T"], 96, 2, 1
        args.device, args.torch_device, args.max_candidates = args.device or "pocl", "cpu", args.max_candidates or 2
    if args.gemm_only:
        gemm_only(args)
        return 0
    cache = tempfile.mkdtemp(prefix="clgpt-tuning-")  # an empty cache: the tuner's first run
    env = dict(os.environ, CLGPT_LAUNCH="gpu", XDG_CACHE_HOME=cache, PYTHONUNBUFFERED="1")
    dev = ["--device", args.device] if args.device else []
    limit = ["--max-candidates", str(args.max_candidates)] if args.max_candidates else []
    py = sys.executable
    files = {}
    print(f"== (a) the tuner's first run (empty cache {cache}), CLGPT_LAUNCH=gpu", flush=True)
    for s in args.shapes:
        files[s] = f"{cache}/{s}.json"
        out, wall = run([py, "-m", "clgpt", "tune-device", *SHAPES[s].split(), *dev, *limit, "--out", files[s]],
                        env, 300)
        tuned = figure(r"tuned in ([\d.]+) s", out)
        print(f"{s}: tuner {tuned:.1f} s (command {wall:.1f} s with startup; "
              + re.search(r"tuned in [\d.]+ s \((.*)\)", out).group(1) + "); "
              + re.search(r"tuned: (.*)", out).group(1), flush=True)
    if args.bf16:
        for s in args.shapes:  # what precision: auto makes of the tuner's pair on this device
            out, _ = run([py, "-m", "clgpt", "bench", *SHAPES[s].split(), "--steps", "1", "--gemm", "0",
                          "--precision", "auto", "--tuning", files[s], *dev], env, 240)
            print(f"{s}: " + re.search(r"precision auto: (.*)", out).group(1), flush=True)
        return storage(args, env, files, dev, limit)
    results = {s: {"tuned": [], "torch": [], "generic": []} for s in args.shapes}
    print(f"== (b, d) training fp32, alternated: clgpt tuned, PyTorch {args.torch_device} eager, clgpt generic "
          "untuned (round 1)", flush=True)
    for r in range(args.reps):
        for s in args.shapes:
            sa, steps = SHAPES[s].split(), str(STEPS[s])
            clgpt = [py, "-m", "clgpt", "bench", *sa, "--steps", steps, "--gemm", "0", "--precision", "fp32", *dev]
            sides = [("tuned", clgpt + ["--tuning", files[s]]),
                     ("torch", [py, "bench/bench_torch.py", *sa, "--steps", steps, "--warmup", "3",
                                "--device", args.torch_device])]
            if r == 0:
                sides.append(("generic", clgpt + ["--tuning", "off"]))
            for side, cmd in sides:
                out, wall = run(cmd, env, 240)
                tps = figure(r"tokens/s=([\d.]+)", out)
                results[s][side].append(tps)
                print(f"round {r + 1} {s} {side}: {tps:,.0f} tokens/s ({wall:.0f} s)", flush=True)
    print(f"== (c) GEMM {args.gemm}^2 fp32, alternated: clgpt (tuned, generic), torch.matmul TF32 off", flush=True)
    gemm = {"tuned": [], "generic": [], "torch": []}
    for r in range(args.reps):
        out, _ = run([py, "bench/generic_gpu.py", "--gemm-only", "--gemm", str(args.gemm), "--gemm-reps",
                      str(args.gemm_reps), *dev, *limit], env, 240)
        for side in ("generic", "tuned"):
            gemm[side].append(figure(rf"gemm {side} \d+\^2 fp32 [^:]*: ([\d.]+) GFLOP/s", out))
        print(out.strip(), flush=True)
        out, _ = run([py, "bench/bench_torch.py", *SHAPES["T"].split(), "--steps", "1", "--warmup", "1",
                      "--gemm", str(args.gemm), "--device", args.torch_device], env, 240)
        gemm["torch"].append(figure(r"torch matmul \([^)]*\) ([\d.]+) GFLOP/s", out))
        print(f"round {r + 1} torch.matmul: {gemm['torch'][-1]:.1f} GFLOP/s", flush=True)
    print("== summary (medians; ratios to PyTorch; goals: training >= 0.8x, GEMM >= 0.75x, tuner < 60 s at L)")
    for s in args.shapes:
        t, tt, g = (statistics.median(results[s][k]) for k in ("tuned", "torch", "generic"))
        print(f"{s}: clgpt tuned {t:,.0f} tokens/s ({t / tt:.2f}x), generic untuned {g:,.0f} ({g / tt:.2f}x), "
              f"PyTorch eager fp32 {tt:,.0f}")
    t, g, tt = (statistics.median(gemm[k]) for k in ("tuned", "generic", "torch"))
    print(f"GEMM {args.gemm}^2: tuned {t:,.0f} GFLOP/s ({t / tt:.2f}x), generic {g:,.0f} ({g / tt:.2f}x), "
          f"torch.matmul {tt:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

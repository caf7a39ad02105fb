"""The portable GEMM forms one by one against torch.matmul fp32 (TF32 off), on the OpenCL device (nothing
NVIDIA-specific: kernels/matmul.cl's tiled form and kernels/matmul_warp.cl's warp-tiled one, launched as the
device tuner launches them), in one process, alternated by rounds (torch, then every form):

    python3 bench/gemm_forms.py [--gemm 4096] [--shapes M6 L] [--reps 3] [--forms warp|all|NAME ...]
                                                                         (bash bench/gpu.sh gemm-forms)

Products: the square --gemm^2 (C = A @ B), then each distinct product one training step of the --shapes runs
(clgpt/device/tuner.py model_products: y = x W.T, dx = dy W, dW = dy.T x, at the bench shapes' batch x ctx rows),
torch.matmul on the same layouts (transposed views, as a PyTorch model runs them). Each form is checked against
float64 numpy first (clgpt/device/tuner.py's check; a form that fails is reported and left out). Prints TFLOP/s
per product and form (best of each round, median over rounds) with the ratio to torch, and per shape the step's
product time (times its count) of each form and of the best form per product (what the tuner can reach) against
torch's. --forms: warp (default: the warp-tiled candidates and the tiled forms the tuner picked on the H100, the
generic and NVIDIA rows), all (every tuner candidate that fits), or candidate descriptions such as
"128x128x8 8x8 warp-tiled". On NVIDIA's OpenCL it also prints each form's registers and spills (ptxas) and
its PTX's fma, local-memory and barrier counts. --tiny: a CPU check of this script (PoCL, torch on the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # bench/generic_gpu.py's: (n_layer, n_embd, n_ff, vocab, batch, ctx)
    "M6": dict(n_layer=6, n_embd=384, n_ff=1536, vocab_size=4096, n_head=6, n_ctx=256, batch=64),
    "L": dict(n_layer=12, n_embd=768, n_ff=3072, vocab_size=8192, n_head=12, n_ctx=512, batch=16),
    "T": dict(n_layer=1, n_embd=32, n_ff=64, vocab_size=96, n_head=2, n_ctx=32, batch=2),  # --tiny
}
# the tiled forms the tuner picked on the H100 (bench/RESULTS_GPU.md): 64x64x8 4x4 at M6, 128x64x8 8x4 at L
EARLIER = ("64x64x8 4x4 float4 double-buffered", "128x64x8 8x4 float4 double-buffered")


def products_of(shape: str):
    from clgpt.device import tuner
    from clgpt.model import ModelConfig

    s = dict(SHAPES[shape])
    batch = s.pop("batch")
    return tuner.model_products(ModelConfig(**s), batch, s["n_ctx"])


def pick_forms(which: list[str], dev):
    from clgpt.device import tuner, tuning

    fit = tuner.candidates(tuner.Limits.of(dev.device))
    named = {tuner._describe_tiles(mm): mm for mm in fit}
    if which == ["all"]:
        return list(named.items())
    if which == ["warp"]:
        keep = [tuner._describe_tiles(tuning._GPU), tuner._describe_tiles(tuning._NVIDIA), *EARLIER]
        keep += [d for d, mm in named.items() if mm.get("WARP")]
        return [(d, named[d]) for d in keep if d in named]
    missing = [w for w in which if w not in named]
    if missing:
        sys.exit(f"--forms: no fitting candidate named {missing[0]!r}; candidates: {'; '.join(named)}")
    return [(w, named[w]) for w in which]


def compiler_report(dev, name: str, mm: dict) -> str:
    """On NVIDIA's OpenCL: what ptxas reported for the form's NN build (registers, spills) and its PTX's count of
    fma, vector local loads, local-memory (spill) accesses and barriers; elsewhere ''."""
    import pyopencl as cl
    from clgpt.ops import matmul_defines

    if "nvidia" not in dev.device.platform.name.lower():
        return ""
    prg = dev.program("matmul", ("-cl-nv-verbose",), TA=0, TB=0, BIAS=0, RESID=0, ACCUM=0, EPI=0,
                      **matmul_defines(mm))
    log = prg.get_build_info(dev.device, cl.program_build_info.LOG)
    regs = " | ".join(x.strip() for x in log.splitlines() if "registers" in x or "spill" in x)
    ptx = prg.binaries[0].decode(errors="replace")
    counts = {k: ptx.count(k) for k in ("fma.rn.f32", "mul.f32", "ld.shared.v4.f32", "ld.shared.f32", "st.local",
                                        "ld.local", "bar.sync", "ld.global.nc.v4", "ld.global.v4")}
    return f"{name}: ptxas {regs[:240]}; ptx " + ", ".join(f"{k} {v}" for k, v in counts.items())


def torch_time(torch, prod, reps: int, device: str) -> float:
    """Seconds a torch.matmul of `prod` (best of reps runs of n launches)."""
    M, N, K, ta, tb = prod
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((K, M) if ta else (M, K), device=device, generator=g)
    b = torch.randn((N, K) if tb else (K, N), device=device, generator=g)
    a, b = (a.t() if ta else a), (b.t() if tb else b)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    c = torch.matmul(a, b)
    sync()
    t0 = time.perf_counter()
    c = torch.matmul(a, b)
    sync()
    n = min(32, max(1, int(0.005 / max(time.perf_counter() - t0, 1e-6))))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            c = torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    del c
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm", type=int, default=4096)
    ap.add_argument("--shapes", nargs="*", default=["M6", "L"], choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=3, help="alternated rounds (torch, then every form)")
    ap.add_argument("--forms", nargs="+", default=["warp"])
    ap.add_argument("--device", default=None, help="the OpenCL device (default: clgpt's choice)")
    ap.add_argument("--torch-device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a CPU check of this script: PoCL, torch on the CPU")
    args = ap.parse_args(argv)
    if args.tiny:
        args.gemm, args.shapes, args.reps = 96, ["T"], 1
        args.device, args.torch_device = args.device or "pocl", "cpu"
    import torch

    if args.torch_device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from clgpt.device import tuner
    from clgpt.device.opencl import get_device

    dev = get_device(args.device)
    print(f"device: {dev.name} | {dev.device.platform.name} {dev.device.version}; torch {torch.__version__} "
          f"{args.torch_device}" + (f" {torch.cuda.get_device_name()}" if args.torch_device == "cuda" else ""),
          flush=True)
    prods: list[tuple[str, tuple, int]] = [("square", (args.gemm, args.gemm, args.gemm, 0, 0), 1)]
    for s in args.shapes:
        prods += [(s, p, c) for p, c in products_of(s)]
    forms = pick_forms(args.forms, dev)
    bench = tuner._Bench(dev, [p for _, p, _ in prods])
    layouts = sorted({(p[3], p[4]) for _, p, _ in prods})
    t0 = time.perf_counter()
    bench.prebuild([(mm, ta, tb, False) for _, mm in forms for ta, tb in layouts])
    good = []
    for name, mm in forms:
        why = next((w for ta, tb in layouts if (w := bench.check(mm, ta, tb, 1))), "")
        print(f"form {name}: {'matches float64' if not why else 'LEFT OUT: ' + why}", flush=True)
        if not why:
            good.append((name, mm))
    print(f"built and checked {len(forms)} forms in {time.perf_counter() - t0:.1f} s", flush=True)
    for name, mm in good:
        rep = compiler_report(dev, name, mm)
        if rep:
            print(rep, flush=True)
    times = {("torch", i): [] for i in range(len(prods))}
    times.update({(name, i): [] for name, _ in good for i in range(len(prods))})
    for r in range(args.reps):
        for i, (_, p, _) in enumerate(prods):
            times["torch", i].append(torch_time(torch, p, 3, args.torch_device))
        for name, mm in good:
            for i, (_, p, _) in enumerate(prods):
                times[name, i].append(bench.time(mm, p, 1, reps=3))
        print(f"round {r + 1} of {args.reps} done", flush=True)
    med = {key: statistics.median(v) for key, v in times.items()}

    def tf(i, t):
        return 2 * prods[i][1][0] * prods[i][1][1] * prods[i][1][2] / t / 1e12

    print("== TFLOP/s per product (median of rounds), ratio to torch.matmul in ()")
    for i, (s, (M, N, K, ta, tb), c) in enumerate(prods):
        row = ", ".join(f"{name} {tf(i, med[name, i]):.1f} ({med['torch', i] / med[name, i]:.2f}x)" for name, _ in good)
        print(f"{s} {M}x{N}x{K} ta={ta} tb={tb} x{c}: torch {tf(i, med['torch', i]):.1f}; {row}", flush=True)
    print("== summary (ratios: torch time / clgpt time; goal >= 0.75x at the square product)")
    best_sq = max(good, key=lambda f: -med[f[0], 0], default=None)
    if best_sq:
        print(f"square {args.gemm}^2 fp32: torch.matmul {tf(0, med['torch', 0]):.1f} TFLOP/s; best form {best_sq[0]} "
              f"{tf(0, med[best_sq[0], 0]):.1f} ({med['torch', 0] / med[best_sq[0], 0]:.2f}x)")
    for s in args.shapes:
        idx = [i for i, (sh, _, _) in enumerate(prods) if sh == s]
        tt = sum(med["torch", i] * prods[i][2] for i in idx)
        per = {name: sum(med[name, i] * prods[i][2] for i in idx) for name, _ in good}
        best = sum(min(med[name, i] for name, _ in good) * prods[i][2] for i in idx) if good else float("nan")
        line = "; ".join(f"{name} {t * 1e3:.2f} ms ({tt / t:.2f}x)" for name, t in per.items())
        print(f"{s} step products: torch {tt * 1e3:.2f} ms; best form per product {best * 1e3:.2f} ms "
              f"({tt / best:.2f}x); {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

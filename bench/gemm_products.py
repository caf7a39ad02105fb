"""Each wgmma product of a clgpt per-kernel profile against torch.matmul (cuBLAS) on the same shape and operand
layout, bf16: where the product time goes and how far each product is from cuBLAS.

    CLGPT_BENCH_PROFILE=1 python3 -m clgpt bench $GPT2S --steps 3 --gemm 0 --precision bf16 > prof.txt
    python3 bench/gemm_products.py prof.txt

The profile's lines name each product `matmul_wgmma[FLAGS] MxNxK` (clgpt/bench.py): C (M, N) = op(A) @ op(B)^T,
A stored K x M with TA (else M x K), B stored K x N with TB (else N x K). Times per launch; torch's are the best
of 3 rounds of 20 launches, timed by CUDA events.
"""
import re
import sys

import torch

LINE = re.compile(r"\s+([\d.]+) ms/step\s+[\d.]+%\s+(\d+)x\s+(matmul_wgmma\[([^\]]*)\]) (\d+)x(\d+)x(\d+)")


def products(path):
    """-> [(seconds a launch, launches a step, label, flags, M, N, K)] of the profile's wgmma products."""
    rows = []
    for line in open(path, encoding="utf-8"):
        m = LINE.match(line)
        if m:
            t, cnt, label, flags, M, N, K = m.groups()
            rows.append((float(t) * 1e-3 / int(cnt), int(cnt), label, flags.split(","), int(M), int(N), int(K)))
    return rows


def best(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return min(times)


def main(path):
    rows = products(path)
    if not rows:
        sys.exit(f"{path}: no matmul_wgmma lines "
                 "(a CLGPT_BENCH_PROFILE=1 run of clgpt bench --precision bf16 on sm_90)")
    ours = theirs = 0.0
    print(f"{'product':46s} {'n':>3s} {'clgpt ms':>8s} {'TF/s':>5s} {'torch ms':>8s} {'TF/s':>5s}  speed")
    for t, cnt, label, flags, M, N, K in sorted(rows, key=lambda r: -r[0] * r[1]):
        bf = dict(device="cuda", dtype=torch.bfloat16)
        a = torch.randn(K, M, **bf).t() if "TA" in flags else torch.randn(M, K, **bf)
        b = torch.randn(K, N, **bf) if "TB" in flags else torch.randn(N, K, **bf).t()
        tt = best(lambda: torch.matmul(a, b)) * 1e-3
        flop = 2 * M * N * K
        ours, theirs = ours + t * cnt, theirs + tt * cnt
        print(f"{label + f' {M}x{N}x{K}':46s} {cnt:3d} {t * 1e3:8.3f} {flop / t / 1e12:5.0f} {tt * 1e3:8.3f} "
              f"{flop / tt / 1e12:5.0f}  {tt / t:.3f}x")
    print(f"all: clgpt {ours * 1e3:.2f} ms a step, torch.matmul {theirs * 1e3:.2f} ({theirs / ours:.3f}x)")


if __name__ == "__main__":
    main(sys.argv[1])

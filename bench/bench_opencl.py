"""`clgpt bench` on each working CPU OpenCL implementation (PoCL, Intel's runtime) at shapes S and M, as
separate processes in alternated pairs; prints each pair's tokens/s and the median ratio against PoCL.

    python bench/bench_opencl.py [--pairs 3] [--shapes S M]
"""

import argparse
import re
import statistics
import subprocess
import sys


SHAPES = {  # clgpt bench's arguments; S is its default shape
    "S": dict(steps=20),
    "M": dict(vocab=4096, ctx=256, embd=256, ffn=1024, heads=4, layers=4, batch=8, steps=3),
}


def tokens_per_s(device: str, shape: dict) -> float:
    args = [f"--{k}={v}" for k, v in shape.items()]
    r = subprocess.run([sys.executable, "-m", "clgpt", "bench", "--device", device, "--gemm", "0", *args],
                       capture_output=True, text=True, check=True)
    return float(re.search(r"tokens/s=([\d.]+)", r.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["S", "M"], choices=sorted(SHAPES))
    args = ap.parse_args()
    from clgpt.device.opencl import cpu_implementations

    impls = cpu_implementations()
    if len(impls) < 2:
        sys.exit(f"error: one CPU OpenCL implementation here ({', '.join(impls)}); this compares two or more")
    print("| shape | " + " | ".join(f"{name} tokens/s" for name in impls) + " | ratio to the first |")
    print("| --- |" + " ---: |" * (len(impls) + 1))
    for shape in args.shapes:
        for name, device in impls.items():  # one untimed run each: compile caches filled
            tokens_per_s(device, dict(SHAPES[shape], steps=1))
        rates = {name: [] for name in impls}
        for r in range(args.pairs):
            order = list(impls.items()) if r % 2 == 0 else list(impls.items())[::-1]
            for name, device in order:
                rates[name].append(tokens_per_s(device, SHAPES[shape]))
        first = next(iter(impls))
        for r in range(args.pairs):
            row = [f"{rates[name][r]:,.0f}" for name in impls]
            ratios = [f"{rates[name][r] / rates[first][r]:.2f}" for name in impls if name != first]
            print(f"| {shape}, pair {r + 1} | " + " | ".join(row) + " | " + ", ".join(ratios) + " |")
        med = [f"{statistics.median(a / b for a, b in zip(rates[name], rates[first])):.2f}x" for name in impls
               if name != first]
        print(f"| {shape}, median | | | **{', '.join(med)}** |")


if __name__ == "__main__":
    main()

"""The device tuner: the portable GEMM's tiles (kernels/matmul.cl `matmul`) measured on the user's own device.

No one can hand-tune tiles for every GPU, so on a device it has not seen clgpt times a bounded set of candidate
tile configurations (CANDIDATES: NVIDIA's hand-tuned rows and the generic row first, then the warp-tiled form of
kernels/matmul_warp.cl, then a grid of tile shapes, depths, vector reads of the local tiles and double buffering)
at the products one training step of the model runs (model_products: C x 3C, C x C, C x 4C, 4C x C, V x C forward,
their dx = dy @ W and dW = dy.T @ x with K = B*T), within the device's limits (work-group size, local memory: fits).
Each candidate is built and checked against a float64 numpy product (odd sizes, and sizes with an aligned tile
inside; every layout it will run) before it is timed; one that fails to build, launch or agree is dropped. The
fastest wins, ties going to the earlier candidate, so the same timings give the same record.

Two rounds keep it short (about 80 builds, on up to 8 threads; bench/generic_gpu.py times it at shape L): every
candidate on two proxy products (the step's largest, and the weight gradient with the fewest outputs), then the
best FINALISTS of each on every product of the step, split-K depths included for the weight gradients. The record (`tune`) holds the big
tiles (the least total time over the step: batched attention and any other product take them), the small ones
(best on the narrow proxy) and, per product shape, the tiles and split-K count that won there; clgpt/ops/gemm/portable.py
looks a product up there first. Tiles never change a sum's order (each output sums k in order); split-K does,
so the record, like the device, decides the bytes: a pinned tuning file repeats a run exactly.

Then one timed pair (`bf16_storage`): each product of the step on its chosen tiles and split, in fp32 and on bf16
storage (kernels/matmul.cl A16, B16 with ROUND=1: bf16 copies of both operands, each copy's making timed with it,
so a copy counts once a product though a weight's or an activation's serves two), alternated, weighted by how often
the step runs it; its checks against float64 of the rounded operands first. `precision: auto` takes bf16 on a GPU
without tensor cores only where that pair's bf16 sum is the smaller (clgpt/device/precision.py).

Records are cached in $XDG_CACHE_HOME/clgpt/tuning (default ~/.cache), one file per device name, driver version
and matmul.cl (matmul_warp.cl inlined; and matmul_bf16.cl, whose to_bf16 makes the copies) source hash, holding one
record per model shape. `resolve` applies the stages' `tuning` setting:
auto (tune GPUs on first use, then read the cache; CPUs keep their register-blocked row), off (the table's row)
or a path to a saved file (pinned: used as written on any device whose row runs the local-memory kernel).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl
from tqdm import tqdm

from clgpt.atomic import atomic_path
from clgpt.device import tuning
from clgpt.device.builds import run_builds
from clgpt.device.opencl import KERNEL_DIR, Device, kernel_source
from clgpt.device.precision import BF16_COPY_OPTIONS
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig

SCHEMA = 1  # the record's format; with the candidate list it is part of the cache key (a new list re-tunes)
FINALISTS = 4  # candidates of each proxy that go on to every product
SPLITS = (2, 4, 8)  # split-K counts tried on the weight gradients (K = B*T deep)
SPLIT_MIN_CHUNK = 128  # shallower chunks are not tried
BUDGET_S = 45.0  # the first round stops taking candidates past this (a slow device still gets a record)
# the float64 check's sizes (K grows for split-K's check): odd ones, no tile divides them, the operands unaligned
# (one-float loads everywhere); then multiples of 4, one 128 x 128 tile inside and edges beyond it, so the float4
# loads and stores of the inner tiles (VEC, the warp-tiled form) are checked too
CHECKS = ((67, 45, 83), (196, 172, 84))
CHECK_MAX = (196, 172, 2 * 32 * max(SPLITS) + 4, 0, 0)
CHECK_TOL = 1e-4  # max |err| / max |ref| of an fp32 product of 83 terms (about 1e-6 when right)


def _row(TSM, TSN, TSK, WPTM, WPTN, LDSV, PREF, VEC=0) -> dict:
    row = dict(kernel="matmul", TSM=TSM, TSN=TSN, TSK=TSK, WPTM=WPTM, WPTN=WPTN, LDSV=LDSV, PREF=PREF)
    return dict(row, VEC=1) if VEC else row


def _warp_row(TSM, TSN, TSK, WPTM, WPTN) -> dict:
    """kernels/matmul_warp.cl's form (WARP=1): always float4 local reads (LDSV) and two local buffers (PREF)."""
    return dict(_row(TSM, TSN, TSK, WPTM, WPTN, 1, 1), WARP=1)


WARP_LANES_N = 8  # matmul_warp.cl's default WARPN: a warp's 32 work-items as 8 along n by 4 along m


def stored16(mm: dict) -> dict:
    """The tiles `mm` on bf16 storage: bf16 copies of both operands (kernels/matmul.cl A16, B16), ROUND=1."""
    return dict(mm, ROUND=1, A16=1, B16=1)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bf16, nearest even (finite values: the check's normal operands)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _vec_ok(mm: dict) -> bool:
    """kernels/matmul.cl's VEC=1 condition: each work-item a whole number of float4 of each tile."""
    nt = (mm["TSM"] // mm["WPTM"]) * (mm["TSN"] // mm["WPTN"])
    return not ((mm["TSK"] * mm["TSM"]) % (4 * nt) or (mm["TSK"] * mm["TSN"]) % (4 * nt) or mm["TSK"] % 4)


def _candidates() -> list[dict]:
    """The table's rows first (NVIDIA's hand-tuned ones are starting points like any other), then the warp-tiled
    form (kernels/matmul_warp.cl: CUTLASS's 128 x 128 x 8 with 8 x 8 a work-item, and the tile shapes that won on
    the H100 at M6 and L, 64 x 64 x 8 with 4 x 4 and 128 x 64 x 8 with 8 x 4, at depths 8 and 16), then a grid: six
    tile shapes of 64 to 256 work-items, depths 8 and 16, double-buffered, the local tiles read as float4, the
    global loads as float4 (VEC, where each work-item loads whole float4) or not, and a narrow 64 x 32 tile for
    small outputs. Duplicates are dropped, the first kept (31 in all)."""
    seeds = [tuning._NVIDIA, tuning._NVIDIA_NARROW, tuning._GPU, tuning._GPU_SMALL, tuning._NVIDIA_SMALL]
    out = [_row(s["TSM"], s["TSN"], s["TSK"], s["WPTM"], s["WPTN"], s.get("LDSV", 0), s.get("PREF", 0)) for s in seeds]
    for tsm, tsn, wm, wn in ((128, 128, 8, 8), (128, 64, 8, 4), (64, 64, 4, 4)):
        for tsk in (8, 16):
            out.append(_warp_row(tsm, tsn, tsk, wm, wn))
    for tsm, tsn, wm, wn in ((128, 128, 8, 8), (128, 64, 8, 4), (64, 128, 4, 8), (64, 64, 4, 4), (64, 64, 8, 8),
                             (128, 64, 8, 8)):
        for tsk in (8, 16):
            for vec in (1, 0):
                row = _row(tsm, tsn, tsk, wm, wn, 1, 1, vec)
                if row not in out and (not vec or _vec_ok(row)):
                    out.append(row)
    out.append(_row(64, 32, 16, 4, 4, 1, 1, 1))
    return out


CANDIDATES = _candidates()


@dataclass(frozen=True)
class Limits:
    """What a device allows a work-group: work-items (in all and along dimensions 0 and 1) and local memory."""

    max_group: int
    max_dims: tuple[int, int]
    local_mem: int

    @classmethod
    def of(cls, device: cl.Device) -> "Limits":
        sizes = device.max_work_item_sizes
        return cls(device.max_work_group_size, (sizes[0], sizes[1]), device.local_mem_size)


def local_bytes(mm: dict) -> int:
    """The local memory kernels/matmul.cl's `matmul` declares for the tiles `mm` (As, Bs with +4 padding; the
    warp-tiled form's likewise, always two buffers)."""
    return (2 if mm.get("PREF") else 1) * mm["TSK"] * (mm["TSM"] + 4 + mm["TSN"] + 4) * 4


def fits(mm: dict, lim: Limits) -> str:
    """"" where the tiles `mm` can run under `lim`, else why not."""
    if mm["TSM"] % mm["WPTM"] or mm["TSN"] % mm["WPTN"]:
        return "tile not a multiple of the outputs per work-item"
    if mm.get("LDSV") and (mm["WPTM"] % 4 or mm["WPTN"] % 4):
        return "float4 reads need WPTM, WPTN multiples of 4"
    if mm.get("VEC") and not _vec_ok(mm):
        return "float4 global loads need whole float4 of each tile per work-item"
    rn, rm = mm["TSN"] // mm["WPTN"], mm["TSM"] // mm["WPTM"]
    if mm.get("WARP"):
        lanes_n = mm.get("WARPN", WARP_LANES_N)
        if (mm["WPTM"] % 4 or mm["WPTN"] % 4 or mm["TSK"] % 4 or 32 % lanes_n or (rn * rm) % 32
                or mm["TSM"] % (mm["WPTM"] * 32 // lanes_n) or mm["TSN"] % (mm["WPTN"] * lanes_n)):
            return "the warp-tiled form needs whole warps of 32 work-items, whole warp tiles and multiples of 4"
    if rn * rm > lim.max_group or rn > lim.max_dims[0] or rm > lim.max_dims[1]:
        return f"{rn} x {rm} work-items exceed the device's work-group limit {lim.max_group}"
    if local_bytes(mm) > lim.local_mem:
        return f"{local_bytes(mm)} bytes of local memory exceed the device's {lim.local_mem}"
    return ""


def candidates(lim: Limits) -> list[dict]:
    """CANDIDATES that fit the limits `lim`, in order."""
    return [mm for mm in CANDIDATES if not fits(mm, lim)]


# ---- the products a step runs ----
Product = tuple[int, int, int, int, int]  # (M, N, K, ta, tb) of kernels/matmul.cl


def model_products(cfg: ModelConfig, batch_size: int, seq_len: int) -> list[tuple[Product, int]]:
    """[(product, times a step)] of the linear layers and the output head of `cfg` at batch_size x seq_len rows,
    in a fixed order: y = x @ W.T (0, 1), dx = dy @ W (0, 0), dW += dy.T @ x (1, 0) for each (n_out, n_in)."""
    C, F, V, N = cfg.n_embd, cfg.n_ff, cfg.vocab_size, batch_size * seq_len
    if cfg.arch == "llama":
        layers = [(C + 2 * cfg.kv_heads * cfg.head_dim, C), (C, C), (2 * F, C), (C, F)]
    else:
        layers = [(3 * C, C), (C, C), (F, C), (C, F)]
    counts: dict[Product, int] = {}
    for (n_out, n_in), times in [(w, cfg.n_layer) for w in layers] + [((V, C), 1)]:
        for prod in ((N, n_out, n_in, 0, 1), (N, n_in, n_out, 0, 0), (n_out, n_in, N, 1, 0)):
            counts[prod] = counts.get(prod, 0) + times
    return list(counts.items())


def model_key(products: list[tuple[Product, int]]) -> str:
    """The record's name in a cache file: the products and their counts."""
    return ";".join(f"{m}x{n}x{k}:{ta}{tb}*{c}" for (m, n, k, ta, tb), c in products)


def _splittable(prod: Product) -> bool:
    """Weight gradients (dy.T @ x: no bias, residual or epilogue) deep enough to split (clgpt/ops/gemm/portable.py)."""
    return prod[3] == 1 and prod[2] >= tuning.SPLIT_MIN_TOTAL_K


# ---- measuring ----
class _Bench:
    """Buffers for the largest product, the kernels (built as clgpt/ops/gemm/portable.py builds them, so the run reuses the
    programs), one timed launch, and the float64 check."""

    def __init__(self, dev: Device, products: list[Product]):
        self.dev = dev
        rng = np.random.default_rng(0)
        na = max(m * k for m, n, k, ta, tb in products + [CHECK_MAX])
        nb = max(k * n for m, n, k, ta, tb in products + [CHECK_MAX])
        # split-K's parts: only the weight gradients split (and the check)
        nc = max(m * n * max(SPLITS) for m, n, k, ta, tb in [p for p in products if _splittable(p)] + [CHECK_MAX])
        mf = cl.mem_flags
        self.A = cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=rng.standard_normal(na, np.float32))
        self.B = cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=rng.standard_normal(nb, np.float32))
        self.C = cl.Buffer(dev.ctx, mf.READ_WRITE, 4 * max(m * n for m, n, *_ in products + [CHECK_MAX]))
        self.P = cl.Buffer(dev.ctx, mf.READ_WRITE, 4 * nc)
        self.checked: set = set()
        # bf16 storage: the operands' copies (rows and columns padded to 32, as the engine's), made when first used
        self.products = products + [CHECK_MAX]
        self.A16 = self.B16 = None

    def kernel(self, mm: dict, ta: int, tb: int, split: bool) -> cl.Kernel:
        extra = dict(SPLITK=1) if split else {}
        return self.dev.kernel("matmul", "matmul", TA=ta, TB=tb, BIAS=0, RESID=0, ACCUM=0, EPI=0, **extra,
                               **{k: v for k, v in mm.items() if k not in ("kernel", "lsize")})

    def prebuild(self, jobs: list[tuple[dict, int, int, bool]]) -> None:
        """Build the kernels of `jobs` (tiles, ta, tb, split) on a few threads: the builds, not the launches,
        are most of a first run. A build that fails is left for the candidate's check to meet again and reject."""
        def build(job):
            try:
                self.kernel(*job)
            except (cl.Error, ClgptError):
                pass
        run_builds([lambda job=job: build(job) for job in jobs])

    def to_bf16(self, X, rows: int, cols: int, out) -> int:
        """X (rows x cols) -> its bf16 copy in `out` as the portable GEMM makes it (clgpt/ops/gemm/portable.py);
        -> the copy's row length."""
        Rp, Cp = _pad32(rows), _pad32(cols)
        i32 = np.int32
        self.dev.kernel("matmul_bf16", "to_bf16", **BF16_COPY_OPTIONS)(
            self.dev.queue, (Cp // 8, Rp), (4, 32), i32(rows), i32(cols), X, i32(cols), out, i32(Cp))
        return Cp

    def launch(self, mm: dict, prod: Product, S: int, A=None, B=None, C=None) -> None:
        """One product (split S ways); on bf16 storage (mm stored16) the copies of both operands made first."""
        M, N, K, ta, tb = prod
        A, B, C = A or self.A, B or self.B, C or self.C
        (gx, gy), lsize = _launch_size(mm, M, N)
        i32 = np.int32
        lda, ldb = (M if ta else K), (K if tb else N)
        if mm.get("A16"):
            if self.A16 is None:
                mf = cl.mem_flags
                self.A16 = cl.Buffer(self.dev.ctx, mf.READ_WRITE, 2 * max(
                    _pad32(k if ta else m) * _pad32(m if ta else k) for m, n, k, ta, tb in self.products))
                self.B16 = cl.Buffer(self.dev.ctx, mf.READ_WRITE, 2 * max(
                    _pad32(n if tb else k) * _pad32(k if tb else n) for m, n, k, ta, tb in self.products))
            lda = self.to_bf16(A, *((K, M) if ta else (M, K)), self.A16)
            ldb = self.to_bf16(B, *((N, K) if tb else (K, N)), self.B16)
            A, B = self.A16, self.B16
        args = [i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb)]
        if S > 1:
            kc = -(-K // S)
            kc = -(-kc // mm["TSK"]) * mm["TSK"]
            S = -(-K // kc)
            kern = self.kernel(mm, ta, tb, True)
            kern(self.dev.queue, (gx, gy, S), (*lsize, 1), *args, self.P, i32(N), None, None, np.float32(1.0), None,
                 i32(kc), i32(1), *(i32(0),) * 9)
            self.dev.kernel("matmul", "splitk_reduce")(self.dev.queue, (M * N,), None, i32(M * N), i32(S), i32(0),
                                                        np.float32(1.0), self.P, C)
        else:
            self.kernel(mm, ta, tb, False)(self.dev.queue, (gx, gy), lsize, *args, C, i32(N), None, None,
                                           np.float32(1.0), None)

    def check(self, mm: dict, ta: int, tb: int, S: int) -> str:
        """"" where the tiles `mm` in layout (ta, tb) (split S ways) match float64 numpy at CHECKS' sizes."""
        key = (id(mm), ta, tb, S)
        if key in self.checked:
            return ""
        for M, N, K in CHECKS:
            if S > 1:
                K = S * 2 * mm["TSK"] + (3 if K % 2 else 4)  # S chunks, the last one partial
            why = self._check(mm, ta, tb, S, M, N, K)
            if why:
                return why
        self.checked.add(key)
        return ""

    def _check(self, mm: dict, ta: int, tb: int, S: int, M: int, N: int, K: int) -> str:
        rng = np.random.default_rng(1)
        a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
        q = self.dev.queue
        cl.enqueue_copy(q, self.A, a)
        cl.enqueue_copy(q, self.B, b)
        self.launch(mm, (M, N, K, ta, tb), S)
        out = np.empty(M * N, np.float32)
        cl.enqueue_copy(q, out, self.C, is_blocking=True)
        if mm.get("ROUND") == 1:  # bf16 operands: exact products, fp32 sums
            a, b = round_bf16(a), round_bf16(b)
        ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
        err = float(np.abs(out.reshape(M, N) - ref).max() / np.abs(ref).max())
        if not err <= CHECK_TOL:
            return f"disagrees with float64 numpy at {M}x{N}x{K} (max rel err {err:.2e})"
        return ""

    def time(self, mm: dict, prod: Product, S: int, reps: int = 2) -> float:
        """Seconds a launch of `prod`: after an untimed one, the least of `reps` timed runs of n launches each, n
        enough for a run of about 2 ms (at most 32), so a small product's time is not the host's wait on it."""
        self.launch(mm, prod, S)
        self.dev.queue.finish()
        t0 = time.perf_counter()
        self.launch(mm, prod, S)
        self.dev.queue.finish()
        n = min(32, max(1, int(0.002 / max(time.perf_counter() - t0, 1e-6))))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                self.launch(mm, prod, S)
            self.dev.queue.finish()
            best = min(best, (time.perf_counter() - t0) / n)
        return best


def _launch_size(mm, M, N):
    lsize = (mm["TSN"] // mm["WPTN"], mm["TSM"] // mm["WPTM"])
    return (-(-N // mm["TSN"]) * lsize[0], -(-M // mm["TSM"]) * lsize[1]), lsize


def _flops(prod: Product) -> int:
    return 2 * prod[0] * prod[1] * prod[2]


def _proxies(products: list[tuple[Product, int]]) -> list[Product]:
    """The product of the most FLOPs a step, and the weight gradient with the fewest outputs among those of at
    least a twentieth of that (a deep, narrow product: the small tiles' and split-K's case)."""
    big = max(products, key=lambda pc: (_flops(pc[0]) * pc[1], pc[0]))[0]
    floor = _flops(big) // 20
    grads = [p for p, c in products if p[3] == 1 and _flops(p) * c >= floor]
    small = min(grads, key=lambda p: (p[0] * p[1], p)) if grads else big
    return [big] if small == big else [big, small]


def tune(dev: Device, products: list[tuple[Product, int]], cands: list[dict] | None = None, measure=None,
         budget_s: float = BUDGET_S, progress: bool = True) -> dict:
    """The tuning record of `dev` for a step's `products` (model_products). cands: the candidates (default: those
    of CANDIDATES that fit the device); measure(mm, product, S) -> seconds replaces the timed launches (tests).
    Candidates that fail to build, launch or match float64 are dropped (record["rejected"] says why)."""
    t0 = time.perf_counter()
    cands = candidates(Limits.of(dev.device)) if cands is None else cands
    bench = _Bench(dev, [p for p, _ in products])
    measure = measure or bench.time
    rejected: dict[int, str] = {}

    def timed(i, prod, S):
        if i in rejected:
            return float("inf")
        try:
            why = bench.check(cands[i], prod[3], prod[4], S)
            if not why:
                return float(measure(cands[i], prod, S))
        except (cl.Error, ClgptError) as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rejected[i] = why
        return float("inf")

    proxies = _proxies(products)
    bench.prebuild([(mm, p[3], p[4], False) for mm in cands for p in proxies])
    bar = tqdm(total=len(cands) * len(proxies), desc="tuning GEMM (candidates)", unit="run", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    first: dict[int, list[float]] = {}
    stopped = None
    for i in range(len(cands)):
        if time.perf_counter() - t0 > budget_s and len(first) >= FINALISTS:
            stopped = i
            break
        first[i] = []
        for prod in proxies:
            first[i].append(timed(i, prod, 1))
            bar.update(1)
    bar.close()
    finalists = set()
    for j in range(len(proxies)):
        ranked = sorted((t[j], i) for i, t in first.items() if t[j] < float("inf"))
        finalists.update(i for _, i in ranked[:FINALISTS])
    if not finalists:
        raise ClgptError(f"tuning on {dev.name}: no candidate tiles ran and matched float64 ("
                         f"{next(iter(rejected.values()), 'none fit the device')}); set tuning: off")
    finalists = sorted(finalists)
    runs = [(i, p, 1) for i in finalists for p, _ in products]
    runs += [(i, p, S) for i in finalists for p, _ in products if _splittable(p)
             for S in SPLITS if p[2] // S >= SPLIT_MIN_CHUNK]
    bench.prebuild(list({(id(cands[i]), p[3], p[4], S > 1): (cands[i], p[3], p[4], S > 1)
                         for i, p, S in runs if i not in rejected}.values()))
    bar = tqdm(total=len(runs), desc="tuning GEMM (step products)", unit="run", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    times: dict[tuple, float] = {}
    for i, p, S in runs:
        times[i, p, S] = timed(i, p, S)
        bar.update(1)
    bar.close()
    # the big tiles: the least time over the whole step (unsplit); the small: the best on the narrow proxy
    total = {i: sum(times[i, p, 1] * c for p, c in products) for i in finalists if i not in rejected}
    if not total:
        raise ClgptError(f"tuning on {dev.name}: every finalist failed ({next(iter(rejected.values()))}); "
                         "set tuning: off")
    big = min(total, key=lambda i: (total[i], i))
    small = min(total, key=lambda i: (times[i, proxies[-1], 1], i))
    shapes = []
    for p, _ in products:
        opts = [(t, i, S) for (i, q, S), t in times.items() if q == p and t < float("inf")]
        t, i, S = min(opts, key=lambda o: (o[0], o[2], o[1]))
        shapes.append(dict(product=list(p), tiles=i, split=S, ms=round(t * 1e3, 4)))
    pair = _storage_pair(bench, cands, products, shapes, measure, progress)
    return dict(schema=SCHEMA, candidates=cands, matmul=big, matmul_small=small, products=shapes, bf16_storage=pair,
                rejected={str(i): why for i, why in sorted(rejected.items())},
                stopped_at=stopped, seconds=round(time.perf_counter() - t0, 2),
                step_ms={str(i): round(t * 1e3, 3) for i, t in sorted(total.items())})


def _storage_pair(bench: _Bench, cands: list[dict], products: list[tuple[Product, int]], shapes: list[dict],
                  measure, progress: bool) -> dict:
    """A step's products on their chosen tiles and split, fp32 then bf16 storage, alternated -> dict(fp32_ms,
    bf16_ms) summed over the step (bf16_ms None, and why, where a bf16-storage form failed its check)."""
    picks = [(p, c, cands[s["tiles"]], s["split"]) for (p, c), s in zip(products, shapes)]
    forms = {id(mm): stored16(mm) for _, _, mm, _ in picks}
    bench.prebuild(list({(id(mm), p[3], p[4], S > 1): (forms[id(mm)], p[3], p[4], S > 1)
                         for p, _, mm, S in picks}.values()))
    try:
        bench.dev.kernel("matmul_bf16", "to_bf16", **BF16_COPY_OPTIONS)
        why = next((w for p, _, mm, S in picks for w in [bench.check(forms[id(mm)], p[3], p[4], S)] if w), "")
    except (cl.Error, ClgptError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    t32 = t16 = 0.0
    if not why:
        bar = tqdm(total=2 * len(picks), desc="tuning GEMM (bf16 storage)", unit="run", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True)
        for p, c, mm, S in picks:
            t32 += c * float(measure(mm, p, S))
            t16 += c * float(measure(forms[id(mm)], p, S))
            bar.update(2)
        bar.close()
        return dict(fp32_ms=round(t32 * 1e3, 4), bf16_ms=round(t16 * 1e3, 4))
    return dict(fp32_ms=None, bf16_ms=None, why=why)


def check_record(record, where: str) -> dict:
    """`record` if it is a tuning record this clgpt reads, else a one-line ClgptError naming `where`."""
    try:
        n = len(record["candidates"])
        ok = (record["schema"] == SCHEMA and all(c.get("kernel") == "matmul" for c in record["candidates"])
              and 0 <= record["matmul"] < n and 0 <= record["matmul_small"] < n
              and all(len(s["product"]) == 5 and 0 <= s["tiles"] < n and s["split"] >= 1 for s in record["products"]))
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ClgptError(f"{where}: not a clgpt GEMM tuning record of schema {SCHEMA}; run `clgpt tune-device` "
                         "again or set tuning: auto")
    return record


# ---- the cache ----
def source_hash() -> str:
    """sha256 of kernels/matmul.cl and matmul_bf16.cl as built (includes inlined), the candidates and SCHEMA."""
    text = (kernel_source(KERNEL_DIR / "matmul.cl") + kernel_source(KERNEL_DIR / "matmul_bf16.cl")
            + json.dumps(CANDIDATES) + str(SCHEMA))
    return hashlib.sha256(text.encode()).hexdigest()


def device_id(device: cl.Device) -> dict:
    return dict(name=device.name.strip(), vendor=device.vendor.strip(), platform=device.platform.name.strip(),
                driver=device.driver_version.strip(), version=device.version.strip())


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clgpt" / "tuning"


def cache_file(device: cl.Device) -> Path:
    """This device's file: its name, driver version and the kernel source hash decide it."""
    ident = device_id(device)
    key = hashlib.sha256(json.dumps([ident, source_hash()], sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", ident["name"]).strip("-")[:40] or "device"
    return cache_dir() / f"{slug}-{key}.json"


def read_file(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ClgptError(f"tuning file {path}: {e.strerror}; set tuning: auto or a file `clgpt tune-device` "
                         "wrote") from None
    except ValueError:
        raise ClgptError(f"tuning file {path} is not JSON; set tuning: auto or a file `clgpt tune-device` "
                         "wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), dict):
        raise ClgptError(f"tuning file {path} holds no tuning records; set tuning: auto or a file `clgpt "
                         "tune-device` wrote")
    return data


def save(path: Path, device: cl.Device, key: str, record: dict) -> None:
    """Add `record` under `key` to the file at `path` (made if absent; other records kept), atomically."""
    path = Path(path)
    data = read_file(path) if path.exists() else dict(device=device_id(device), source=source_hash(), records={})
    data["records"][key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(path)) as tmp:
        Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def tuned_for(dev: Device, cfg: ModelConfig, batch_size: int, seq_len: int, retune: bool = False,
              progress: bool = True, say=print) -> tuple[dict, Path, bool]:
    """-> (record, its file, whether it was measured now): this device's cached record for the model's step,
    tuned and cached first where there is none (or retune)."""
    products = model_products(cfg, batch_size, seq_len)
    key, path = model_key(products), cache_file(dev.device)
    if not retune and path.exists():
        rec = read_file(path)["records"].get(key)
        if rec is not None:
            return check_record(rec, str(path)), path, False
    say(f"tuning the GEMM on {dev.name} for this model (first run on this device and driver) ...")
    rec = tune(dev, products, progress=progress)
    save(path, dev.device, key, rec)
    return rec, path, True


def _describe_tiles(mm: dict) -> str:
    if mm.get("WARP"):
        return f"{mm['TSM']}x{mm['TSN']}x{mm['TSK']} {mm['WPTM']}x{mm['WPTN']} warp-tiled"
    return (f"{mm['TSM']}x{mm['TSN']}x{mm['TSK']} {mm['WPTM']}x{mm['WPTN']}{' float4' if mm.get('LDSV') else ''}"
            f"{' float4-loads' if mm.get('VEC') else ''}{' double-buffered' if mm.get('PREF') else ''}")


def describe(record: dict) -> str:
    """One line: the big and small tiles and how many products the record holds."""
    tiles = _describe_tiles
    cands = record["candidates"]
    splits = sum(1 for s in record["products"] if s["split"] > 1)
    pair = record.get("bf16_storage") or {}
    if pair.get("bf16_ms") is not None:
        stored = f"; a step's products {pair['fp32_ms']:.2f} ms fp32, {pair['bf16_ms']:.2f} ms on bf16 storage"
    else:
        stored = f"; bf16 storage not measured ({pair.get('why', 'an older record')})"
    return (f"big tiles {tiles(cands[record['matmul']])}, small {tiles(cands[record['matmul_small']])}, "
            f"{len(record['products'])} product shapes ({splits} split along K){stored}")


def resolve(setting: str, dev: Device, cfg: ModelConfig, batch_size: int, seq_len: int, launch_row: dict,
            progress: bool = True, say=print, may_tune: bool = True) -> tuple[dict | None, str]:
    """The stages' `tuning` setting -> (the record to run with or None, the line for the stage's log).
    auto: GPUs whose row runs the local-memory GEMM are tuned once (then cached); CPUs keep their row. With
    may_tune False (the ranks of a data-parallel stage, which must not each time their own) only the cache counts.
    off: the table's row. Anything else: a saved tuning file, its record for this model, used as written."""
    setting = (setting or "auto").strip()
    local = launch_row.get("matmul", {}).get("kernel") == "matmul"
    if setting == "off":
        return None, "tuning: off (the table's GEMM tiles)"
    if setting == "auto":
        if not (dev.device.type & cl.device_type.GPU) or not local:
            return None, "tuning: auto, none on this device (its row's GEMM tiles)"
        if not may_tune:
            path = cache_file(dev.device)
            key = model_key(model_products(cfg, batch_size, seq_len))
            rec = read_file(path)["records"].get(key) if path.exists() else None
            if rec is None:
                return None, ("tuning: auto, not tuned: ranks read the cache only; run `clgpt tune-device` with the "
                              "stage's model and per-rank batch first (the table's GEMM tiles)")
            return check_record(rec, str(path)), f"tuning: auto, cached: {path} ({describe(rec)})"
        rec, path, fresh = tuned_for(dev, cfg, batch_size, seq_len, progress=progress, say=say)
        how = f"tuned now in {rec['seconds']:.1f} s" if fresh else "cached"
        return rec, f"tuning: auto, {how}: {path} ({describe(rec)})"
    if not local:
        raise ClgptError(f"tuning: {setting}: this device's row runs the CPU GEMM (matmul_rb), which takes no "
                         "tiles; set tuning: auto or off")
    data = read_file(Path(setting))
    key = model_key(model_products(cfg, batch_size, seq_len))
    rec = data["records"].get(key)
    if rec is None:
        raise ClgptError(f"tuning file {setting} has no record for this model and batch ({key.split(';')[0]} ...); "
                         "run `clgpt tune-device` with the stage's model and batch, or set tuning: auto")
    return check_record(rec, setting), f"tuning: pinned file {setting} ({describe(rec)})"

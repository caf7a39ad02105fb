"""`clgpt bench`: training speed on random tokens, and the engine's GEMM beside numpy's.

Prints the OpenCL device, ms per training step (forward, zero_grad, backward, clip + AdamW; warmup steps
excluded), the GEMM figure -- C = A @ B at --gemm squared, float32, launched through the engine's own
`eng.matmul`, clgpt.ops (the kernel, tiles and launch shape that training uses) -- beside numpy's `A @ B` on the
same machine in the same run, with the ratio and a check of the OpenCL result against float64 numpy.
The last line is exactly `tokens/s=<number>`.

With CLGPT_BENCH_PROFILE=1 it also trains a few steps on a second engine whose queue has profiling on and
prints where the device time goes, per kernel (and per matmul shape), before the last line.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import numpy as np

from clgpt.device import knobs
from clgpt.errors import ClgptError

WARMUP = 3
GEMM_TOL = 1e-4  # max |C - ref| / max |ref| for float32 against float64
# reduced-precision operands (random normal, n <= 4096): unit roundoff 2^-8 (bf16), 2^-11 (tf32) per operand
GEMM_TOL_PRECISION = {"fp32": GEMM_TOL, "tf32": 2e-3, "bf16": 1e-2}
PROFILE_STEPS = 3


def _blas_info() -> str:
    """numpy's BLAS and the kernel it runs, where threadpoolctl is there to say."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "numpy BLAS (threadpoolctl not installed: kernel unknown)"
    for lib in threadpool_info():
        if lib.get("user_api") == "blas":
            arch = lib.get("architecture") or "?"
            return f"{lib.get('internal_api')} {lib.get('version')} {arch} kernel, {lib.get('num_threads')} threads"
    return "numpy BLAS unknown"


def _best_time(fn, sync, min_time: float = 0.2, rounds: int = 3) -> float:
    """Seconds per call: grow a repeat count until one round takes >= min_time, then best of `rounds`."""
    reps = 1
    while True:
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_time or reps >= 1 << 14:
            break
        reps *= 4 if dt < min_time / 8 else 2
    best = dt / reps
    for _ in range(rounds - 1):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def gemm_figure(eng, n: int, seed: int = 0) -> dict:
    """C = A @ B (n x n float32) through eng.matmul and through numpy -> GFLOP/s of both, max rel error."""
    import pyopencl as cl

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    mf = cl.mem_flags
    da = cl.Buffer(eng.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    db = cl.Buffer(eng.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
    dc = cl.Buffer(eng.ctx, mf.READ_WRITE, a.nbytes)
    q = eng.queue

    def cl_gemm():
        eng.matmul(n, n, n, da, db, dc)  # ta=0, tb=0: as the engine computes dx = dy @ W

    cl_gemm()
    c = np.empty_like(a)
    cl.enqueue_copy(q, c, dc, is_blocking=True)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.abs(c - ref).max() / np.abs(ref).max())
    t_cl = _best_time(cl_gemm, q.finish)
    t_np = _best_time(lambda: a @ b, lambda: None)
    flops = 2.0 * n**3
    return dict(cl=flops / t_cl / 1e9, np=flops / t_np / 1e9, err=err,
                ok=bool(np.isfinite(err) and err <= GEMM_TOL_PRECISION[eng.precision]))


# ---- per-kernel profile ----


class _Recorder:
    """Stands in for a cl.Kernel: launches it and keeps (label, event)."""

    def __init__(self, kernel, label, log):
        self.kernel, self.label, self.log = kernel, label, log

    def __call__(self, queue, gsize, lsize, *args, **kw):
        ev = self.kernel(queue, gsize, lsize, *args, **kw)
        label = self.label
        if label.startswith("matmul"):  # M, N, K are the first three arguments
            label = f"{label} {int(args[0])}x{int(args[1])}x{int(args[2])}"
        self.log.append((label, ev))
        return ev

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _profiling_device(dev):
    """A second Device on the same OpenCL device, with a profiling queue and recording kernels."""
    import pyopencl as cl

    from clgpt.device.opencl import Device

    class ProfDevice(Device):
        def __init__(self, d):
            super().__init__(d)
            self.queue = cl.CommandQueue(self.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
            self.log = []

        def kernel(self, file_stem, name, **defines):
            k = super().kernel(file_stem, name, **defines)
            label = name
            if name.startswith("matmul"):
                flags = [f if defines.get(f) == 1 else f"{f}{defines.get(f)}"
                         for f in ("TA", "TB", "BIAS", "RESID", "ACCUM", "EPI", "GROUP", "SPLITK") if defines.get(f)]
                if name == "matmul_wgmma":  # which of its tile rows
                    flags.append(f"{defines['BM']}x{defines['BN']}")
                label = f"{name}[" + (",".join(flags) or "NN") + "]"
            return _Recorder(k, label, self.log)

    return ProfDevice(dev.device)


def profile(cfg, params, B, T, dev, batches, precision="fp32", kn=None) -> list[str]:
    """Train PROFILE_STEPS steps with event profiling; -> report lines (device time per kernel)."""
    from clgpt.models.factory import make_engine

    pdev = _profiling_device(dev)
    eng = make_engine(cfg, params, batch_size=B, seq_len=T, device=pdev, precision=precision, knobs=kn)
    for tok, tgt in batches[:2]:  # warm: first launches compile nothing, but fault in buffers
        eng.forward(tok, tgt)
        eng.zero_grad()
        eng.backward()
        eng.step(3e-4, clip=1.0)
    pdev.queue.finish()
    pdev.log.clear()
    t0 = time.perf_counter()
    for i in range(PROFILE_STEPS):
        tok, tgt = batches[i % len(batches)]
        eng.forward(tok, tgt)
        eng.zero_grad()
        eng.backward()
        eng.step(3e-4, clip=1.0)
    pdev.queue.finish()
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    tot, cnt = defaultdict(float), defaultdict(int)
    for label, ev in pdev.log:
        tot[label] += (ev.profile.end - ev.profile.start) * 1e-9
        cnt[label] += 1
    dev_time = sum(tot.values()) / PROFILE_STEPS
    lines = [
        f"profile ({PROFILE_STEPS} steps, profiling queue): wall {wall * 1e3:.2f} ms/step, kernels {dev_time * 1e3:.2f} "
        f"ms/step in {len(pdev.log) // PROFILE_STEPS} launches, rest (host, copies, launch gaps) "
        f"{(wall - dev_time) * 1e3:.2f} ms/step"
    ]
    for label in sorted(tot, key=tot.get, reverse=True):
        t = tot[label] / PROFILE_STEPS
        lines.append(f"  {t * 1e3:8.3f} ms/step {100 * t / max(dev_time, 1e-12):5.1f}%  "
                     f"{cnt[label] // PROFILE_STEPS:3d}x  {label}")
    return lines


# ---- the bench ----


def device_bytes(eng) -> int:
    """Bytes of the device buffers an engine holds (activations, parameters, optimizer state, scratch): every
    cl.Buffer reachable from the engine, its Ops and its parameter store, sub-buffers not counted apart."""
    import pyopencl as cl

    seen, total = set(), 0
    todo = [vars(eng), vars(eng.ops), vars(eng.store)]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, cl.Buffer) and x.int_ptr not in seen:
            seen.add(x.int_ptr)
            if x.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT) is None:
                total += x.size
    return total


def run_bench(args) -> None:
    from clgpt.device.opencl import get_device
    from clgpt.model import ModelConfig, init_params, num_params
    from clgpt.models.factory import make_engine

    if args.steps < 1:
        raise ClgptError(f"bench: --steps must be at least 1, got {args.steps}")
    if args.gemm < 0:
        raise ClgptError(f"bench: --gemm must be 0 (skip) or a positive size, got {args.gemm}")
    arch = getattr(args, "arch", "gpt2")
    moe = dict(n_head_kv=getattr(args, "kv_heads", 0), n_expert=getattr(args, "experts", 0),
               n_expert_used=getattr(args, "experts_used", 0)) if arch == "llama" else {}
    cfg = ModelConfig(arch=arch, vocab_size=args.vocab, n_ctx=args.ctx, n_embd=args.embd, n_head=args.heads,
                      n_layer=args.layers, n_ff=args.ffn, **moe)
    cfg.validate("bench")
    B, T, V = args.batch, args.ctx, args.vocab
    if B < 1:
        raise ClgptError(f"bench: --batch must be at least 1, got {B}")
    dev = get_device(args.device)
    d = dev.device
    print(f"device: {dev.name} ({d.platform.name.strip()}, {d.max_compute_units} compute units, {d.version.strip()})")
    experts = f" E={cfg.n_expert} K={cfg.n_expert_used}" if cfg.n_expert else ""
    print(f"model: {cfg.arch} V={V} T={T} C={cfg.n_embd} F={cfg.n_ff} H={cfg.n_head} Hkv={cfg.kv_heads}{experts} "
          f"L={cfg.n_layer} B={B}, "
          f"{num_params(cfg):,} parameters")
    sys.stdout.flush()

    params = init_params(cfg, 0)
    t0 = time.perf_counter()
    dropout = float(getattr(args, "dropout", 0.0))
    kn = with_tuning(getattr(args, "tuning", "off"), dev, cfg, B, T, knobs.read())  # once, at the bench's edge
    eng = make_engine(cfg, params, batch_size=B, seq_len=T, device=dev, precision=getattr(args, "precision", "fp32"),
                      dropout=dropout, attention=getattr(args, "attention", "auto"), knobs=kn)
    t_init = time.perf_counter() - t0
    if getattr(args, "precision", "fp32") == "auto":
        from clgpt.device.precision import auto_reason

        print(f"precision auto: {auto_reason(dev.device, kn)}")

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, size=(B, T), dtype=np.int32), rng.integers(0, V, size=(B, T), dtype=np.int32))
               for _ in range(8)]

    def train_step(i):
        tok, tgt = batches[i % len(batches)]
        loss = eng.forward(tok, tgt, **({"dropout_seed": i} if dropout else {}))
        eng.zero_grad()
        eng.backward()
        eng.step(3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0)
        return loss

    t0 = time.perf_counter()
    for i in range(WARMUP):
        first = train_step(i)
    eng.queue.finish()
    t_warm = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        loss = train_step(WARMUP + i)
    eng.queue.finish()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if not (np.isfinite(first) and np.isfinite(loss)):
        raise ClgptError(f"bench: the loss is not finite ({first} then {loss})")
    ms = dt / args.steps * 1e3
    tps = B * T * args.steps / dt
    print(f"train: {args.steps} steps after {WARMUP} warmup ({t_init:.2f} s engine setup, {t_warm:.2f} s warmup), "
          f"loss {first:.4f} -> {loss:.4f}, {ms:.2f} ms/step, precision {eng.precision}{' (tensor cores)' if eng.mma else ''}{f', dropout {dropout}' if dropout else ''}, {cpu / args.steps * 1e3:.2f} ms CPU time/step (all threads)")
    mem = device_bytes(eng)
    print(f"memory: {mem / 2**20:.1f} MiB of device buffers, {mem / (B * T) / 1024:.1f} KiB a token")
    sys.stdout.flush()

    gemm_ok = True
    if args.gemm:
        n = args.gemm
        g = gemm_figure(eng, n)
        gemm_ok = g["ok"]
        print(f"gemm {n}^2 {eng.precision} C=A@B: OpenCL {g['cl']:.2f} GFLOP/s, numpy {g['np']:.2f} GFLOP/s "
              f"({_blas_info()}), OpenCL/numpy = {g['cl'] / g['np']:.3f}")
        print(f"gemm check: {'passed' if gemm_ok else 'FAILED'} (max rel err {g['err']:.2e} against float64 numpy, "
              f"tolerance {GEMM_TOL_PRECISION[eng.precision]:g})")
    if kn.bench_profile:
        for line in profile(cfg, params, B, T, dev, batches, eng.precision, kn):
            print(line)
    if not gemm_ok:
        raise ClgptError("bench: the OpenCL GEMM disagrees with numpy (see 'gemm check' above)")
    print(f"tokens/s={tps:.1f}")


def with_tuning(setting: str, dev, cfg, B: int, T: int, kn: knobs.Knobs) -> knobs.Knobs:
    """`kn` with the records the `tuning` setting gives (clgpt.training.tuned), their lines printed."""
    from clgpt.training.tuned import tuned_knobs

    kn, lines = tuned_knobs(setting, dev, cfg, B, T, kn)
    print("\n".join(lines))
    sys.stdout.flush()
    return kn


def run_tune_device(args) -> None:
    """`clgpt tune-device`: measure the portable GEMM's tiles, portable flash attention's and the row kernels'
    forms on the device for one model and batch (always, even where the cache has them, and on a CPU too), cache the records and, with --out,
    write them there as well."""
    from pathlib import Path

    from dataclasses import replace

    from clgpt.device import tuner, tuner_flash, tuner_rows
    from clgpt.device.builds import BuildsBeside
    from clgpt.device.opencl import get_device
    from clgpt.device.tuning import launch_config
    from clgpt.model import ModelConfig
    from clgpt.ops import attention_seconds
    from clgpt.training.tuned import candidate_builds

    cfg = ModelConfig(arch=args.arch, vocab_size=args.vocab, n_ctx=args.ctx, n_embd=args.embd, n_head=args.heads,
                      n_layer=args.layers, n_ff=args.ffn,
                      **(dict(n_head_kv=args.kv_heads) if args.arch == "llama" else {}))
    cfg.validate("tune-device")
    dev = get_device(args.device)
    products = tuner.model_products(cfg, args.batch, args.ctx)
    print(f"device: {dev.name} ({dev.device.platform.name.strip()}, driver {dev.device.driver_version.strip()}); "
          f"{len(products)} product shapes, {len(tuner.candidates(tuner.Limits.of(dev.device)))} candidate tiles")
    sys.stdout.flush()
    cands = tuner.candidates(tuner.Limits.of(dev.device))[: args.max_candidates or None]
    kn = knobs.read()
    weigh = tuner_flash.wanted(dev.device, launch_config(dev.device, kn), args.ctx, kn) and not tuner_flash.scores_too_big(
        dev.device, cfg, args.batch, args.ctx)  # the row as the stages see it, before the record
    beside = BuildsBeside(candidate_builds(dev, cfg, args.batch, args.ctx, kn, batched=weigh,
                                           max_candidates=args.max_candidates or None))  # built while the GEMM is timed
    try:
        record = tuner.tune(dev, products, cands=cands, budget_s=args.budget)
    finally:
        beside.join()
    key = tuner.model_key(products)
    paths = [tuner.cache_file(dev.device)] + ([Path(args.out)] if args.out else [])
    for path in paths:
        tuner.save(path, dev.device, key, record)
    tuned = replace(kn, gemm_tuning=record)
    batched = (lambda: attention_seconds(dev, cfg, args.batch, args.ctx, tuned)) if weigh else None
    flash = tuner_flash.tune(dev, args.batch, cfg.n_head, args.ctx, cfg.head_dim,
                             max_candidates=args.max_candidates or None, batched=batched)
    for path in paths:
        tuner.save(path, dev.device, tuner_flash.record_key(args.batch, cfg.n_head, args.ctx, cfg.head_dim), flash)
    rows = tuner_rows.tune(dev, cfg, args.batch, args.ctx)
    for path in paths:
        tuner.save(path, dev.device, tuner_rows.record_key(cfg, args.batch, args.ctx), rows)
    for why in sorted({*record["rejected"].values(), *flash["rejected"].values(), *rows["rejected"].values()}):
        print(f"rejected: {why}")
    print(f"tuned in {record['seconds'] + flash['seconds'] + rows['seconds']:.1f} s (GEMM {record['seconds']:.1f}, flash "
          f"attention {flash['seconds']:.1f} with the batched form's {flash.get('batched_seconds', 0.0):.1f}, rows "
          f"{rows['seconds']:.1f})")
    print(f"tuned: {tuner.describe(record)}; flash "
          f"attention {tuner_flash.describe({**flash['tiles'], 'form': flash['form']})}; {tuner_rows.describe(rows)}")
    print("written: " + ", ".join(str(p) for p in paths))


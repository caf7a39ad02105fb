"""Tensor-core checks and figures on an NVIDIA GPU (one device call; see `bash bench/gpu.sh tc`).

    python bench/gpu_tc.py check   # mma kernel vs the portable kernel (same rounding) on this GPU, bit-exact
                                   # rounding (A @ I), determinism, float64 error per precision
    python bench/gpu_tc.py gemm    # 4096^2 bf16 / tf32 through Engine.matmul vs torch.matmul bf16 / tf32,
                                   # per tile shape (CLGPT_MMA: matmul_mma.cl, which bf16 runs on only with
                                   # CLGPT_BF16=off; the bf16 GEMM's own sweep is bench/gemm_tc.py)
    python bench/gpu_tc.py curve   # 200 steps fp32 / tf32 / bf16 on the corpus bytes (shape M), same data;
                                   # a bf16 rerun must give the same bytes
"""
import dataclasses
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.device.knobs import read as read_knobs  # noqa: E402
from clgpt.model import ModelConfig, init_params  # noqa: E402
from clgpt.models import reference as ref  # noqa: E402
from clgpt.models.gpt2 import GPT2Engine  # noqa: E402

dev = get_device()
print("device:", dev.name, "|", dev.device.platform.name, dev.device.version, flush=True)
mf = cl.mem_flags
SMALL = [(40, 30, 1100, 1, 0), (33, 20, 64, 0, 1)] if os.environ.get("GPU_TC_DRY") else None  # dry run (PoCL)
TINY = ModelConfig(vocab_size=64, n_ctx=8, n_embd=16, n_ff=32, n_head=2, n_layer=1)


def buf(a):
    return cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))


def get(b, shape):
    out = np.empty(shape, np.float32)
    cl.enqueue_copy(dev.queue, out, b, is_blocking=True)
    return out


def engine(precision, mma=None, wgmma_min_mnk=None):
    """An engine with the environment's knobs, CLGPT_MMA's tiles replaced by mma; wgmma_min_mnk=0: every bf16
    product on wgmma on sm_90 (None: the table's threshold)."""
    if mma:
        os.environ["CLGPT_MMA"] = mma
    else:
        os.environ.pop("CLGPT_MMA", None)
    kn = dataclasses.replace(read_knobs(), wgmma_min_mnk=wgmma_min_mnk)
    return GPT2Engine(TINY, init_params(TINY, 0), 1, 8, dev, precision=precision, knobs=kn)


def check():
    rng = np.random.default_rng(0)
    bad = 0
    for precision in ("bf16", "tf32"):
        # on sm_90 every bf16 product on wgmma, however small
        tc, port = engine(precision, wgmma_min_mnk=0), engine(precision, wgmma_min_mnk=0)
        assert tc.mma is not None, "no tensor-core path on this device"
        port.ops.matmul = port.ops.gemms.portable.matmul  # the portable kernels (matmul.cl, -D ROUND), same GPU
        rnd = ref.ROUNDERS[precision]
        wg = tc.ops.gemms.wgmma  # None off sm_90
        # rounding: A @ I is exact on either path
        M, K = (256, 128) if not SMALL else (16, 8)
        A = rng.standard_normal((M, K)).astype(np.float32)
        c = buf(np.zeros((M, K), np.float32))
        tc.matmul(M, K, K, buf(A), buf(np.eye(K, dtype=np.float32)), c)
        same = np.array_equal(get(c, (M, K)).view(np.uint32), rnd(A).view(np.uint32))
        print(f"{precision} A @ I == numpy rounding of A, bit for bit: {same}")
        bad += not same
        for (M, N, K, ta, tb) in SMALL or [(4096, 1024, 256, 0, 1), (2048, 256, 1024, 0, 0), (256, 1024, 2048, 1, 0),
                                  (1000, 333, 77, 0, 1), (77, 1000, 333, 0, 0), (333, 77, 1000, 1, 0), (64, 64, 4096, 1, 0),
                                  (300, 520, 200, 1, 1), (16384, 384, 1536, 0, 0), (1536, 384, 16384, 1, 0),
                                  (8192, 768, 4096, 0, 1),  # deep, 192 work-groups on the wide wgmma tile
                                  (3072, 768, 8192, 1, 0), (8192, 768, 768, 0, 1)]:  # where the mid tile may go
            A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            B = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            opA, opB = (A.T if ta else A).astype(np.float64), (B.T if tb else B).astype(np.float64)
            scale = np.abs(opA) @ np.abs(opB)
            outs = []
            for eng in (tc, port, tc):
                c = buf(np.zeros((M, N), np.float32))
                eng.matmul(M, N, K, buf(A), buf(B), c, ta=ta, tb=tb)
                outs.append(get(c, (M, N)))
            d_port = np.abs(outs[0] - outs[1]).max() / scale.max()
            d_round = np.abs(outs[0] - rnd(A.T if ta else A).astype(np.float64) @ rnd(B.T if tb else B)).max() / scale.max()
            d_given = np.abs(outs[0] - opA @ opB).max() / scale.max()
            det = np.array_equal(outs[0], outs[2])
            ok = d_port < 1e-5 and d_round < 1e-5 and det
            bad += not ok
            tile = ""
            if precision == "bf16" and wg is not None and wg.on_wgmma(M, N, K):
                mm = wg.tiles(N, M, K, tb)
                tile = f" wgmma {mm['BM']}x{mm['BN']}"
            print(f"{precision} {M}x{N}x{K} ta={ta} tb={tb}{tile}: |tc - portable| {d_port:.1e}, |tc - f64(rounded)| "
                  f"{d_round:.1e}, |tc - f64(given)| {d_given:.1e} (x max|A||B|), deterministic {det}: "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    bad += check_grouped(rng)
    print("check:", "passed" if not bad else f"{bad} FAILED")


def check_grouped(rng):
    """The expert products (clgpt/ops/grouped.py on matmul_wgmma or matmul_mma with GROUP, bf16) against float64
    of the rounded operands, uneven groups and an empty one: x @ W_e.T (GROUP 1, B_e transposed), h @ V_e (GROUP 1) and the
    weight gradients h_e.T @ x_e (GROUP 2: the character shape whole, a narrow one split along K), twice for
    determinism. -> failures."""
    from clgpt.ops import Ops
    cfg = ModelConfig(arch="llama", vocab_size=64, n_ctx=8, n_embd=16, n_ff=32, n_head=2, n_layer=1, n_expert=4,
                      n_expert_used=2)
    # every grouped product on wgmma where the device has it, however small (as check's dense ones)
    ops = Ops(dev, cfg, 8, precision="bf16", knobs=dataclasses.replace(read_knobs(), wgmma_min_mnk=0))
    assert ops.grouped_mma(), "the grouped products are not on the tensor cores"
    print(f"grouped products on wgmma: {ops.grouped_on_wgmma(1 << 20, 1024, 384, 1 << 20)}", flush=True)
    RM, rnd, bad = ops.grouped_tiles()["RM"], ref.ROUNDERS["bf16"], 0
    # widths multiples of 64: the grouped products take wgmma only then (else mma.sync)
    for C, F, counts in ([(64, 128, [30, 0, 170, 5])] if SMALL else
                         [(384, 1024, [9000, 0, 21000, 2768]), (64, 128, [3000, 0, 5000, 200])]):
        E, counts = len(counts), np.array(counts, np.int32)
        offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)]).astype(np.int32)
        R, offs = int(offs[-1]), offs[:-1].copy()
        x = rng.standard_normal((R, C)).astype(np.float32)
        W, V = (rng.standard_normal((E, F, C)).astype(np.float32) for _ in range(2))  # W_e (F, C), V_e (F, C)
        outs = []
        for _ in range(2):
            h, y = buf(np.zeros((R, F), np.float32)), buf(np.zeros((R, C), np.float32))
            g, bn, bo = buf(np.zeros((E, F, C), np.float32)), buf(counts), buf(offs)
            ops.matmul_grouped_rows(E, R // RM, F, C, buf(x), C, buf(W), C, F * C, h, F, bn, bo, None, tb=1,
                                    packed=R)
            ops.matmul_grouped_rows(E, R // RM, C, F, h, F, buf(V), C, F * C, y, C, bn, bo, None, packed=R)
            ops.matmul_grouped_k(E, F, C, h, F, buf(x), C, g, C, F * C, bn, bo, max_rows=R,
                                 total_rows=int(counts.sum()), packed=R)
            outs.append((get(h, (R, F)), get(y, (R, C)), get(g, (E, F, C))))
        (h, y, g), (h2, y2, g2) = outs
        rx, rh = rnd(x).astype(np.float64), rnd(h).astype(np.float64)
        err = dict(rows_tb=0.0, rows=0.0, k=0.0)
        for e in range(E):
            rows = slice(offs[e], offs[e] + counts[e])
            rW, rV = rnd(W[e]).astype(np.float64), rnd(V[e]).astype(np.float64)
            for key, got, a, b in (("rows_tb", h, rx, rW.T), ("rows", y, rh, rV), ("k", g[e], rh.T, rx)):
                a = a[:, rows] if key == "k" else a[rows]
                b = b[rows] if key == "k" else b
                out = got if key == "k" else got[rows]
                if a.size:
                    err[key] = max(err[key], np.abs(out - a @ b).max() / max((np.abs(a) @ np.abs(b)).max(), 1e-30))
            if not counts[e] and np.abs(g[e]).max() != 0:
                err["k"] = np.inf  # an empty group's gradient is zero
        det = np.array_equal(h, h2) and np.array_equal(y, y2) and np.array_equal(g, g2)
        ok = max(err.values()) < 1e-5 and det
        bad += not ok
        print(f"grouped bf16 C={C} F={F} counts {counts.tolist()}: |tc - f64(rounded)| "
              + ", ".join(f"{k} {v:.1e}" for k, v in err.items()) + f" (x max|A||B|), deterministic {det}: "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return bad


def gemm(n=4096):
    import torch

    rng = np.random.default_rng(0)
    A = rng.standard_normal((n, n), dtype=np.float32)
    B = rng.standard_normal((n, n), dtype=np.float32)
    fl = 2.0 * n**3

    def best(fn, sync, reps=10, rounds=5):
        fn()
        sync()
        t = 1e9
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            t = min(t, (time.perf_counter() - t0) / reps)
        return t

    ta, tb = torch.from_numpy(A).cuda(), torch.from_numpy(B).cuda()
    torch_tf = {}
    a16, b16 = ta.bfloat16(), tb.bfloat16()
    torch_tf["bf16"] = fl / best(lambda: a16 @ b16, torch.cuda.synchronize) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = True
    torch_tf["tf32"] = fl / best(lambda: ta @ tb, torch.cuda.synchronize) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    torch_tf["fp32"] = fl / best(lambda: ta @ tb, torch.cuda.synchronize) / 1e12
    print(f"torch.matmul {n}^2: bf16 (bf16 tensors) {torch_tf['bf16']:.1f}, tf32 {torch_tf['tf32']:.1f}, "
          f"fp32 {torch_tf['fp32']:.1f} TFLOP/s", flush=True)
    del a16, b16, ta, tb
    torch.cuda.empty_cache()
    dA, dB, dC = buf(A), buf(B), cl.Buffer(dev.ctx, mf.READ_WRITE, n * n * 4)
    configs = [None, "BM=128,BN=128,WM=2,WN=2", "BM=128,BN=128,WM=4,WN=2", "BM=64,BN=128,WM=2,WN=2",
               "BM=64,BN=64,WM=2,WN=2"]
    os.environ["CLGPT_NV_VERBOSE"] = "1"
    speed = {}
    for precision in ("bf16", "tf32"):
        for spec in configs:
            for tb in (0, 1):
                try:
                    eng = engine(precision, spec)
                    t = best(lambda: eng.matmul(n, n, n, dA, dB, dC, tb=tb), dev.queue.finish)
                    tf = fl / t / 1e12
                    speed.setdefault((precision, spec), []).append(tf)
                    print(f"clgpt {precision} {spec or 'default (' + str(eng.mma[0]) + ')'} tb={tb}: {tf:.1f} TFLOP/s, "
                          f"{t * 1e3:.2f} ms, clgpt/torch {precision} = {tf / torch_tf[precision]:.3f}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"clgpt {precision} {spec} tb={tb}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    seen = set()
    for (stem, opts), prg in dev._programs.items():  # registers and spills ptxas reported (-cl-nv-verbose)
        if stem != "matmul_mma" or "-cl-nv-verbose" not in opts:
            continue
        log = prg.get_build_info(dev.device, cl.program_build_info.LOG)
        lines = " | ".join(x.strip() for x in log.splitlines() if "registers" in x or "spill" in x or "stack" in x)
        tag = " ".join(o for o in opts if o.split("=")[0] in ("-DBM", "-DBN", "-DWM", "-DWN", "-DROUND", "-DTB", "-DTA")
                       or o.startswith("-cl-nv-maxrreg"))
        if tag not in seen:
            seen.add(tag)
            print(f"ptxas {tag}: {lines[:300]}")
    cands = [s for s in speed if s[0] == "bf16" and len(speed[s]) == 2]
    if cands:
        best = max(cands, key=lambda s: sum(speed[s]))
        print(f"fastest bf16 tiles here (mean of tb=0/1): {best[1] or 'default'} {sum(speed[best]) / 2:.1f} TFLOP/s "
              "(training may differ: bench/RESULTS_GPU.md)")


def curve(steps=200):
    cfg = ModelConfig(vocab_size=4096, n_ctx=256, n_embd=256, n_ff=1024, n_head=4, n_layer=4)
    B, T = 8, 256
    if SMALL:
        cfg, B, T, steps = ModelConfig(vocab_size=256, n_ctx=16, n_embd=16, n_ff=32, n_head=2, n_layer=1), 2, 16, 3
    text = b"\n".join(p.read_bytes() for p in sorted(Path("data/pretrain").glob("*.txt")))
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(data) - T - 1, size=(steps, B))
    curves, hashes = {}, {}
    for precision in ("fp32", "tf32", "bf16", "bf16"):
        eng = GPT2Engine(cfg, init_params(cfg, 0), B, T, dev, precision=precision, knobs=read_knobs())
        losses = []
        t0 = time.perf_counter()
        for s in range(steps):
            tok = np.stack([data[i: i + T] for i in starts[s]])
            tgt = np.stack([data[i + 1: i + T + 1] for i in starts[s]])
            losses.append(eng.forward(tok, tgt))
            eng.zero_grad()
            eng.backward()
            lr = 1e-3 * min(1.0, (s + 1) / 20)
            eng.step(lr)
        dt = time.perf_counter() - t0
        h = hashlib.sha256(b"".join(v.tobytes() for v in eng.get_params().values())).hexdigest()[:16]
        if precision in curves:
            print(f"bf16 rerun: same losses {curves[precision] == losses}, same weights {hashes[precision] == h}")
            continue
        curves[precision], hashes[precision] = losses, h
        print(f"{precision}: loss at steps 1/50/100/150/200: "
              + " ".join(f"{losses[min(i, steps - 1)]:.4f}" for i in (0, 49, 99, 149, 199)) + f" ({dt:.1f} s, weights {h})", flush=True)
    f = np.array(curves["fp32"])
    for precision in ("tf32", "bf16"):
        d = np.abs(np.array(curves[precision]) - f)
        print(f"{precision} - fp32: max |diff| over steps 1-200 {d.max():.4f}, over 101-200 {d[100:].max() if steps > 100 else 0:.4f}, "
              f"mean of the last 50 losses {np.mean(curves[precision][-50:]):.4f} vs fp32 {np.mean(f[-50:]):.4f}")


if __name__ == "__main__":
    for what in sys.argv[1:] or ["check", "gemm", "curve"]:
        t0 = time.perf_counter()
        {"check": check, "gemm": gemm, "curve": curve}[what]()
        print(f"[{what}: {time.perf_counter() - t0:.1f} s]", flush=True)

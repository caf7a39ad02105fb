"""Data-parallel scaling over MPI (clgpt.training.dist): tokens/s of one rank against N ranks, where each goes.

    mpiexec -n 2 python bench/bench_mpi.py --shape S6 --shape L [--accum 1 --accum 4] [--curve 40]

Per shape (S6: 6 layers, 384 channels, batch 64, context 256, vocab 8192; L: 12 layers, 768 channels,
batch 16, context 512, vocab 8192; or --custom "V,T,C,F,H,L,B"):
- weak scaling: rank 0 alone trains with its batch B (one device), then all N ranks train with B each
  (global batch N*B), both through clgpt.training.train.accumulate_grads + Engine.step, the code the stages run;
  N ranks twice: the all-reduce after the backward pass, and (the default) during it, layer by layer;
  tokens/s of each and the speedup N-rank / 1-rank, for every --accum (micro-batches per optimizer step:
  the all-reduce runs once per step, so accumulation shrinks its share);
- where an N-rank step goes: forward+backward, gradients to the host and back, and the all-reduce in its
  variants (fp32 in 4 MB buckets, the default; fp32 as one message; bf16 on the wire; through shared memory);
- --curve STEPS: the loss curve of one rank against N ranks at the SAME global batch B (each rank B/N rows)
  on a learnable synthetic token stream, with the stages' lr schedule: training quality unchanged.
Random tokens for the throughput runs (no data loading in the timing). Rank 0 prints; --json writes all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from clgpt.model import ModelConfig, init_params, num_params  # noqa: E402
from clgpt.models.factory import make_engine  # noqa: E402
from clgpt.training.dist import BUCKET, Dist  # noqa: E402
from clgpt.training.train import ADAM_EPS, PretrainBatches, accumulate_grads, lr_at  # noqa: E402
from clgpt.device.knobs import read as read_knobs  # noqa: E402

SHAPES = {  # V, T, C, F, H, L, B (per rank)
    "S6": (8192, 256, 384, 1536, 6, 6, 64),
    "L": (8192, 512, 768, 3072, 12, 12, 16),
}


class RandomBatches:
    """A few pre-drawn random (tokens, targets) micro-batches, cycled: no host work inside the timing."""

    def __init__(self, B, T, V, n=4):
        rng = np.random.default_rng(0)
        self.b = [(rng.integers(0, V, (B, T), dtype=np.int32), rng.integers(0, V, (B, T), dtype=np.int32))
                  for _ in range(n)]
        self.mask, self.i = np.ones((B, T), np.float32), 0

    def next(self):
        tok, tgt = self.b[self.i % len(self.b)]
        self.i += 1
        return tok, tgt, self.mask, tok.size


def timed_steps(eng, batches, accum, dist, steps, warmup, overlap=True, via="mpi"):
    """Seconds per optimizer step (accumulate_grads + AdamW), after `warmup` steps; via: how the gradients
    are summed (MPI messages, or shared memory: clgpt.training.dist)."""
    prev, dist.via = dist.via, via
    for i in range(warmup + steps):
        if i == warmup:
            eng.queue.finish()
            dist.barrier()
            t0 = time.perf_counter()
        accumulate_grads(eng, batches, accum, dist, overlap=overlap)
        eng.step(3e-4, 0.9, 0.95, ADAM_EPS, 0.1, 1.0)
    eng.queue.finish()
    dist.barrier()
    dist.via = prev
    return (time.perf_counter() - t0) / steps


def best(fn, reps=3):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def breakdown(eng, batches, dist, world) -> dict:
    """Milliseconds (median of 3) of each part of an N-rank step with one micro-batch."""
    out = {}

    def compute():
        tok, tgt, mask, _ = batches.next()
        eng.zero_grad()
        eng.forward(tok, tgt, mask)
        eng.backward(1.0)
        eng.queue.finish()

    out["forward+backward"] = best(compute)[1]
    g = eng.get_grads_flat()
    out["grads to host (get_grads_flat)"] = best(eng.get_grads_flat)[1]
    out["grads to device (set_grads_flat)"] = best(lambda: eng.set_grads_flat(g))[1]
    store = eng.store
    host = store.pinned(store.n_flat)
    out["grads to host, page-locked (read_grads_async, what the overlapped reduce does)"] = best(
        lambda: eng.read_grads_async(store.order, host).wait())[1]
    out["grads to device, page-locked (write_grads)"] = best(lambda: (store.write_grads(host), eng.queue.finish()))[1]
    for name, kw in (("all-reduce fp32, 4 MB buckets (MPI messages, CLGPT_REDUCE=mpi)", {"via": "mpi"}),
                     ("all-reduce fp32, one message", {"via": "mpi", "bucket": g.size}),
                     ("all-reduce bf16 wire, 4 MB buckets", {"via": "mpi", "wire": "bf16"}),
                     ("all-reduce fp32, 16 MB buckets", {"via": "mpi", "bucket": 4 * BUCKET}),
                     ("all-reduce fp32 through shared memory, 4 MB buckets", {"via": "shm"}),
                     ("all-reduce fp32 through shared memory, 16 MB buckets (default on one host)",
                      {"via": "shm", "bucket": 4 * BUCKET, "threads": 1}),
                     ("all-reduce fp32 through shared memory, 16 MB buckets, 8 threads",
                      {"via": "shm", "bucket": 4 * BUCKET, "threads": 8})):
        def reduce():
            world.barrier()
            via, threads = dist.via, dist.threads
            dist.via, dist.threads = kw["via"], kw.get("threads", threads)
            dist.allreduce_sum(g, **{k: v for k, v in kw.items() if k not in ("via", "threads")})
            dist.via, dist.threads = via, threads
        out[name] = best(reduce)[1]

    def mpi_allreduce():
        from mpi4py import MPI

        world.barrier()
        r = np.empty_like(g)
        world.Allreduce(g, r, op=MPI.SUM)
    out["(reference: MPI_Allreduce fp32, library order)"] = best(mpi_allreduce)[1]
    out["AdamW step"] = best(lambda: (eng.step(0.0, 0.9, 0.95, ADAM_EPS, 0.0, 1.0), eng.queue.finish()))[1]
    return {k: 1e3 * v for k, v in out.items()}


def synthetic_stream(V, n=1 << 20, seed=0) -> np.ndarray:
    """A learnable token stream: each next id is a fixed function of the previous one plus noise of 0..3,
    so the loss can fall from ln V towards ln 4."""
    rng = np.random.default_rng(seed)
    step = rng.integers(1, V, V)
    ids = np.empty(n, np.int64)
    ids[0] = 0
    noise = rng.integers(0, 4, n)
    for i in range(1, n):
        ids[i] = (ids[i - 1] + step[ids[i - 1]] + noise[i]) % V
    return ids.astype(np.uint16 if V <= 65536 else np.int32)


def curve(cfg, params, B, T, steps, world, dev) -> dict:
    """Loss per step: rank 0 alone with B rows, then every rank with B/N rows of the same batches."""
    ids = synthetic_stream(cfg.vocab_size)
    s = {"seed": 1234, "batch_size": B, "seq_len": T}
    lr, min_lr, warm = 1e-3, 1e-4, max(1, steps // 10)
    losses = {}
    for label, dist in (("1 rank", Dist(None) if world.Get_rank() == 0 else None), (f"{world.Get_size()} ranks",
                                                                                    Dist(world))):
        if dist is not None:
            eng = make_engine(cfg, params, batch_size=-(-B // dist.size), seq_len=T, device=dev, knobs=read_knobs())
            batches = PretrainBatches(ids, s, "synthetic")
            ls = []
            for step in range(steps):
                loss, _, _ = accumulate_grads(eng, batches, 1, dist)
                eng.step(lr_at(step, steps, lr, min_lr, warm), 0.9, 0.95, ADAM_EPS, 0.1, 1.0)
                ls.append(loss)
            losses[label] = ls
            del eng
        world.Barrier()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), default=[])
    ap.add_argument("--custom", action="append", default=[], help='"V,T,C,F,H,L,B" (B per rank)')
    ap.add_argument("--accum", action="append", type=int, default=[])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--curve", type=int, default=0, help="steps of the 1-vs-N loss curve on the first shape")
    ap.add_argument("--devices", default="", help="comma-separated device specs, one per local rank")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dist = Dist(world, "bench")
    root = dist.root
    dev = dist.device(None, [d for d in a.devices.split(",") if d] or None)
    say = print if root else (lambda *x, **k: None)
    table = dist.describe(dev.name)
    one_host = all(world.allgather(dist.node.Get_size() == dist.size))
    say(f"bench_mpi: {dist.size} ranks: {table}", flush=True)
    shapes = [(n, SHAPES[n]) for n in a.shape] + [(c, tuple(int(x) for x in c.split(","))) for c in a.custom]
    results = {"ranks": dist.size, "ranks_table": table, "shapes": []}
    for name, (V, T, C, F, H, L, B) in shapes or [("S6", SHAPES["S6"])]:
        cfg = ModelConfig(vocab_size=V, n_ctx=max(256, T), n_embd=C, n_head=H, n_layer=L, n_ff=F)
        params = init_params(cfg, 0)
        eng = make_engine(cfg, params, batch_size=B, seq_len=T, device=dev, knobs=read_knobs())
        batches = RandomBatches(B, T, V)
        say(f"\n== {name}: V={V} T={T} C={C} F={F} H={H} L={L}, B={B} per rank, {num_params(cfg):,} parameters "
            f"({4 * num_params(cfg) / 2**20:.0f} MiB of fp32 gradients)", flush=True)
        r = {"shape": name, "V": V, "T": T, "C": C, "F": F, "H": H, "L": L, "B": B, "params": num_params(cfg),
             "runs": []}
        for accum in a.accum or [1]:
            one = None
            if root:
                one = timed_steps(eng, batches, accum, Dist(None), a.steps, a.warmup)
            world.Barrier()
            plain = timed_steps(eng, batches, accum, dist, a.steps, a.warmup, overlap=False, via="mpi")
            many = timed_steps(eng, batches, accum, dist, a.steps, a.warmup, overlap=True, via="mpi")
            shm = timed_steps(eng, batches, accum, dist, a.steps, a.warmup, overlap=True, via="shm") if one_host else 0
            if root:
                tok = B * T * accum
                t1, tp, tn = tok / one, dist.size * tok / plain, dist.size * tok / many
                ts = dist.size * tok / shm if shm else 0.0
                say(f"accum {accum}: 1 rank {one * 1e3:.1f} ms/step {t1:,.0f} tokens/s | {dist.size} ranks, reduce "
                    f"after backward {plain * 1e3:.1f} ms/step {tp:,.0f} tokens/s ({tp / t1:.2f}x) | {dist.size} ranks, "
                    f"reduce during backward (MPI messages) {many * 1e3:.1f} ms/step {tn:,.0f} tokens/s | speedup "
                    f"{tn / t1:.2f}x | {dist.size} ranks, during backward, shared memory (default on one host) "
                    f"{shm * 1e3:.1f} ms/step {ts:,.0f} tokens/s ({ts / t1:.2f}x)", flush=True)
                r["runs"].append({"accum": accum, "ms_1": one * 1e3, "ms_n_after": plain * 1e3, "ms_n": many * 1e3,
                                  "tok_s_1": t1, "tok_s_n_after": tp, "tok_s_n": tn, "speedup": tn / t1,
                                  "speedup_after": tp / t1, "ms_n_shm": shm * 1e3, "tok_s_n_shm": ts,
                                  "speedup_shm": ts / t1})
        # the overlapped reduce (engine grad hook, page-locked copies) against one reduce after backward: same bits
        grads = []
        for overlap in (True, False):
            batches.i = 0
            accumulate_grads(eng, batches, 2, dist, overlap=overlap)
            grads.append(eng.get_grads_flat())
        same = grads[0].tobytes() == grads[1].tobytes() and dist.overlapped(eng) is not None
        say(f"reduce during backward == reduce after backward, bit for bit: {same}", flush=True)
        r["overlap_bits_equal"] = same
        parts = breakdown(eng, batches, dist, world)
        for k, v in parts.items():
            say(f"  {v:9.2f} ms  {k}")
        r["breakdown_ms"] = parts
        del eng
        if a.curve and name == (shapes[0][0] if shapes else "S6"):
            losses = curve(cfg, params, B, T, a.curve, world, dev)
            if root:
                l1, ln = losses["1 rank"], losses[f"{dist.size} ranks"]
                rel = max(abs(x - y) / abs(x) for x, y in zip(l1, ln))
                say(f"loss curve, global batch {B} ({B // dist.size} rows a rank), {a.curve} steps: 1 rank "
                    f"{l1[0]:.4f} -> {l1[-1]:.4f}, {dist.size} ranks {ln[0]:.4f} -> {ln[-1]:.4f}; largest relative "
                    f"difference over the curve {rel:.2e}")
                for i in sorted({0, 1, 2, 4, 9, 19, a.curve // 2, a.curve - 1} & set(range(a.curve))):
                    say(f"  step {i + 1:4d}  1 rank {l1[i]:.5f}  {dist.size} ranks {ln[i]:.5f}")
                r["curve"] = {"steps": a.curve, "global_batch": B, "one": l1, "n": ln, "max_rel_diff": rel}
        results["shapes"].append(r)
    if root and a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if root:
        ok = all(max(run["speedup"], run["speedup_shm"]) >= 1.8 for r in results["shapes"] for run in r["runs"])
        say(f"\nweak-scaling target >= 1.8x: {'met' if ok else 'NOT met'} on every run" if dist.size == 2 else "")


if __name__ == "__main__":
    main()

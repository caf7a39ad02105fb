"""Full tuning against LoRA (tune.lora) on one model: the time of an optimizer step (wall and this process's CPU
time, which includes PoCL's worker threads) and the device memory each engine allocates, in one process, the two
engines' steps alternating so that both see the same machine load.

    PYTHONPATH=$PWD python bench/lora_tune.py results/pretrain/model.ckpt --rank 16 --alpha 32 --rounds 5 --steps 4

The batch is the default tune stage's shape (16 rows of 160 tokens) of random tokens, every position counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from clgpt.io.checkpoint import load_checkpoint
from clgpt.models.factory import make_engine
from clgpt.models.lora import lora_spec
from clgpt.models.lora_engine import LoraEngine
from clgpt.ops import Ops
from clgpt.device.knobs import read as read_knobs  # noqa: E402


class _Counted:
    """Counts the bytes of the buffers Ops.buf allocates while it is active."""

    def __enter__(self):
        self.bytes, self._buf = 0, Ops.buf

        def buf(ops, nfloats):
            self.bytes += max(1, int(nfloats)) * 4
            return self._buf(ops, nfloats)

        Ops.buf = buf
        return self

    def __exit__(self, *exc):
        Ops.buf = self._buf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    ck = load_checkpoint(args.checkpoint)
    cfg, params = ck["cfg"], ck["params"]
    B, T = args.batch, args.seq
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    engines, memory = {}, {}
    with _Counted() as c:
        engines["full"] = make_engine(cfg, params, batch_size=B, seq_len=T, knobs=read_knobs())
    memory["full"] = c.bytes
    spec = lora_spec({"rank": args.rank, "alpha": args.alpha}, cfg)
    with _Counted() as c:
        engines["lora"] = LoraEngine(make_engine(cfg, params, batch_size=B, seq_len=T, optimizer=False, knobs=read_knobs()), spec, seed=0)
    memory["lora"] = c.bytes
    times = {k: [] for k in engines}
    for r in range(args.rounds + 1):  # round 0 warms up (kernel builds)
        for name, eng in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                eng.zero_grad()
                eng.forward(tokens, targets)
                eng.backward()
                eng.step(1e-3)
            w1, c1 = time.perf_counter(), time.process_time()
            if r:
                times[name].append(((w1 - w0) / args.steps * 1e3, (c1 - c0) / args.steps * 1e3))
    print(f"model {cfg.arch} C={cfg.n_embd} L={cfg.n_layer} F={cfg.n_ff} V={cfg.vocab_size}; batch {B}x{T}; "
          f"LoRA rank {spec.rank} alpha {spec.alpha} on {', '.join(spec.targets)}")
    print(f"{'':6} {'wall ms/step (median)':>22} {'CPU ms/step (median)':>22} {'device buffers MB':>18}")
    for name in engines:
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        print(f"{name:6} {wall:22.1f} {cpu:22.1f} {memory[name] / 1e6:18.2f}")
    ratio = [lo[1] / fu[1] for lo, fu in zip(times["lora"], times["full"])]
    print(f"lora/full CPU per step, by round: {' '.join(f'{x:.3f}' for x in ratio)}; "
          f"median {statistics.median(ratio):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

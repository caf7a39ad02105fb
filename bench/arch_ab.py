"""Same-process A/B timing: clgpt gpt2 against clgpt llama, and clgpt llama against its PyTorch peer.

    python bench/arch_ab.py [--shape default|S|M] [--rounds 5] [--steps 4] [--threads 0|1]
                            [--what arch,torch] [--profile]

On a machine shared with other work only ratios measured in the same run mean anything: every engine is built
once in this one process, then the runs alternate (gpt2, llama, torch, gpt2, llama, torch, ...) for --rounds
rounds of --steps training steps each (forward, zero_grad, backward, clip + AdamW on random tokens, after 3
warmup steps). Per round it prints wall and process CPU ms per step of each and the ratios; at the end the
median ratio over the rounds (and the ratio of the least times). --what arch: gpt2 vs llama only; torch: llama
vs the PyTorch llama peer only (bench/bench_torch.py's model: SDPA, foreach AdamW, eager fp32).
--threads 1: PoCL (POCL_CPU_MAX_CU_COUNT) and torch on one thread each; 0: each one's default (all cores).
--profile: per-kernel device time of gpt2 and llama (clgpt.bench.profile) before the timing.

Shapes (clgpt bench / bench/compare.sh flags): default = the default model's widths (V 1024, T 64, C 128, H 4,
L 2, F 512, B 16); S and M as bench/compare.sh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = {  # V, T, C, F, H, L, B
    "default": (1024, 64, 128, 512, 4, 2, 16),
    "S": (512, 80, 64, 128, 2, 1, 8),
    "M": (4096, 256, 256, 1024, 4, 4, 8),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="default", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--what", default="arch,torch")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if args.threads > 0:  # before PoCL starts
        os.environ["POCL_CPU_MAX_CU_COUNT"] = os.environ["POCL_MAX_PTHREAD_COUNT"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np

    from clgpt.bench import profile
    from clgpt.device import get_device
    from clgpt.engine import make_engine
    from clgpt.model import ModelConfig, init_params

    what = set(args.what.split(","))
    V, T, C, F, H, L, B = SHAPES[args.shape]
    dev = get_device(None)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, (B, T), dtype=np.int32), rng.integers(0, V, (B, T), dtype=np.int32))
               for _ in range(8)]
    runners = {}
    archs = ["gpt2", "llama"] if "arch" in what else ["llama"]
    for arch in archs:
        cfg = ModelConfig(arch=arch, vocab_size=V, n_ctx=T, n_embd=C, n_head=H, n_layer=L, n_ff=F)
        params = init_params(cfg, 0)
        eng = make_engine(cfg, params, batch_size=B, seq_len=T, device=dev)
        if args.profile:
            for line in profile(cfg, params, B, T, dev, batches):
                print(f"[{arch}] {line}")

        def step(i, eng=eng):
            tok, tgt = batches[i % len(batches)]
            eng.forward(tok, tgt)
            eng.zero_grad()
            eng.backward()
            eng.step(3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0)

        runners[f"clgpt-{arch}"] = (step, eng.queue.finish)
    if "torch" in what:
        import torch

        from bench_torch import build_llama

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        model = build_llama(torch, V, T, C, F, H, H, L, 0, 0, False)
        decay = [p for p in model.parameters() if p.dim() == 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
        tb = [(torch.from_numpy(t.astype(np.int64)), torch.from_numpy(y.astype(np.int64))) for t, y in batches]

        def tstep(i):
            xb, yb = tb[i % len(tb)]
            loss = model(xb, yb)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        runners["torch-llama"] = (tstep, lambda: None)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"device: {dev.name}; shape {args.shape}: V={V} T={T} C={C} F={F} H={H} L={L} B={B}; "
          f"threads {args.threads or 'default'}; load average {open('/proc/loadavg').read().split()[:3]}")
    for name, (fn, sync) in runners.items():  # warmup
        for i in range(3):
            fn(i)
        sync()
    pairs = []
    if "arch" in what:
        pairs.append(("clgpt-llama", "clgpt-gpt2"))
    if "torch" in what:
        pairs.append(("clgpt-llama", "torch-llama"))
    times = {name: [] for name in runners}
    for r in range(args.rounds):
        row = []
        for name, (fn, sync) in runners.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                fn(i)
            sync()
            wall, cpu = (time.perf_counter() - t0) / args.steps * 1e3, (time.process_time() - c0) / args.steps * 1e3
            times[name].append((wall, cpu))
            row.append(f"{name} {wall:.1f} ms ({cpu:.1f} CPU)")
        ratios = [f"{a}/{b} {times[a][-1][0] / times[b][-1][0]:.3f} ({times[a][-1][1] / times[b][-1][1]:.3f} CPU)"
                  for a, b in pairs]
        print(f"round {r + 1}: " + ", ".join(row) + " | " + ", ".join(ratios))
        sys.stdout.flush()
    for a, b in pairs:
        rw = [x[0] / y[0] for x, y in zip(times[a], times[b])]
        rc = [x[1] / y[1] for x, y in zip(times[a], times[b])]
        least = min(x[0] for x in times[a]) / min(y[0] for y in times[b])
        least_c = min(x[1] for x in times[a]) / min(y[1] for y in times[b])
        print(f"{a}/{b} time per token: median wall {statistics.median(rw):.3f} (rounds {min(rw):.3f}-{max(rw):.3f}), "
              f"median CPU {statistics.median(rc):.3f}; least/least wall {least:.3f}, CPU {least_c:.3f}")
    print(f"load average after {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

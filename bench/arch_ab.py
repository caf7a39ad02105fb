"""Same-process A/B timing: clgpt gpt2 against clgpt llama, and clgpt llama against its PyTorch peer.

    python bench/arch_ab.py [--shape default|S|M] [--repeats 5] [--steps 4] [--threads 0|1]
                            [--what arch,moe,torch] [--same-ffn] [--profile]

On a machine shared with other work only ratios measured in the same run mean anything.
--what arch: gpt2 against llama (moe: and 4 experts top-2 against dense llama), the engines built once in this
one process, then the runs alternate (gpt2, llama, moe, gpt2, llama, ...) for --rounds rounds of --steps training steps each (forward, zero_grad, backward,
clip + AdamW on random tokens, after 3 warmup steps). Per round it prints wall and process CPU ms per step of
each and the time ratio; at the end the median ratio over the rounds (and the ratio of the least times).
--what torch: clgpt llama against the PyTorch llama peer (bench/bench_torch.py's model: SDPA, foreach AdamW,
eager fp32), alternating `clgpt bench` and bench_torch.py processes (--steps steps each after their own 3
warmup steps), printing the speed ratio (torch time / clgpt time) per round and its median.
--threads 1: PoCL (POCL_CPU_MAX_CU_COUNT) and torch on one thread each; 0: each one's default (all cores).
--profile: per-kernel device time of gpt2 and llama (clgpt.bench.profile) before the timing.

Shapes (clgpt bench / bench/compare.sh flags): default = the default model's widths (V 1024, T 64, C 128, H 4,
L 2, B 16); S and M as bench/compare.sh. F is gpt2's (4 C); llama (its peer, and each expert) takes llama's
usual width (clgpt.model.usual_n_ff: 2/3 of that, up to a multiple of 32: the same parameters and matmul
FLOPs), or gpt2's F with --same-ffn.
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


def _run(cmd, env) -> tuple[float, float]:
    """-> (ms/step, CPU ms/step) from a `clgpt bench` or bench_torch.py run's train: line."""
    import re
    import subprocess

    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    m = re.search(r", ([0-9.]+) ms/step, (?:precision \w+, )?([0-9.]+) ms CPU time/step", out)  # clgpt names its precision
    if m is None:
        raise RuntimeError(f"no train: line with ms/step in the output of {' '.join(cmd)}:\n{out[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def llama_ffn(args) -> int:
    from clgpt.model import usual_n_ff

    V, T, C, F, H, L, B = SHAPES[args.shape]
    return F if args.same_ffn else usual_n_ff("llama", C)


def torch_rounds(args):
    """clgpt llama against the PyTorch llama peer: separate processes (PoCL's worker threads and torch's OpenMP
    ones in one process slow torch down up to 10x), alternating clgpt, torch, clgpt, torch, ... in this call."""
    V, T, C, F, H, L, B = SHAPES[args.shape]
    F = llama_ffn(args)
    here = os.path.dirname(os.path.abspath(__file__))
    flags = (f"--vocab {V} --ctx {T} --embd {C} --ffn {F} --heads {H} --layers {L} --batch {B} "
             f"--steps {args.steps} --arch llama --gemm 0").split()
    env = dict(os.environ, PYTHONPATH=os.path.join(here, "..") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmds = {"clgpt-llama": [sys.executable, "-m", "clgpt", "bench", *flags],
            "torch-llama": [sys.executable, os.path.join(here, "bench_torch.py"), *flags,
                            "--threads", str(args.threads)]}
    print(f"llama vs PyTorch llama peer, shape {args.shape}: V={V} T={T} C={C} F={F} H={H} L={L} B={B}; "
          f"threads {args.threads or 'default'}; separate processes; load average "
          f"{open('/proc/loadavg').read().split()[:3]}")
    speed, speed_cpu, res = [], [], {}
    for r in range(args.rounds):
        for name, cmd in cmds.items():
            res[name] = _run(cmd, env)
        (cw, cc), (tw, tc) = res["clgpt-llama"], res["torch-llama"]
        speed.append(tw / cw)
        speed_cpu.append(tc / cc)
        print(f"round {r + 1}: clgpt-llama {cw:.1f} ms ({cc:.1f} CPU), torch-llama {tw:.1f} ms ({tc:.1f} CPU) | "
              f"clgpt/torch speed {tw / cw:.3f} ({tc / cc:.3f} CPU)")
        sys.stdout.flush()
    print(f"clgpt-llama/torch-llama speed (torch time / clgpt time, > 1: clgpt faster): median wall "
          f"{statistics.median(speed):.3f} (rounds {min(speed):.3f}-{max(speed):.3f}), median CPU "
          f"{statistics.median(speed_cpu):.3f}; load average after {open('/proc/loadavg').read().split()[:3]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="default", choices=sorted(SHAPES))
    ap.add_argument("--repeats", "--rounds", dest="rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--what", default="arch,torch")
    ap.add_argument("--same-ffn", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if args.threads > 0:  # before PoCL starts
        os.environ["POCL_CPU_MAX_CU_COUNT"] = os.environ["POCL_MAX_PTHREAD_COUNT"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np

    from clgpt.bench import profile
    from clgpt.device.opencl import get_device
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.factory import make_engine
    from clgpt.device.knobs import read as read_knobs

    what = set(args.what.split(","))
    V, T, C, F, H, L, B = SHAPES[args.shape]
    dev = get_device(None)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, (B, T), dtype=np.int32), rng.integers(0, V, (B, T), dtype=np.int32))
               for _ in range(8)]
    if "torch" in what and not what & {"arch", "moe"}:
        torch_rounds(args)
        return 0
    runners = {}
    archs = (["gpt2", "llama"] if "arch" in what else []) + (["moe"] if "moe" in what else [])
    for arch in archs:
        moe = dict(n_expert=4, n_expert_used=2) if arch == "moe" else {}
        cfg = ModelConfig(arch="gpt2" if arch == "gpt2" else "llama", vocab_size=V, n_ctx=T, n_embd=C, n_head=H,
                          n_layer=L, n_ff=F if arch == "gpt2" else llama_ffn(args), **moe)
        params = init_params(cfg, 0)
        eng = make_engine(cfg, params, batch_size=B, seq_len=T, device=dev, knobs=read_knobs())
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
    print(f"device: {dev.name}; shape {args.shape}: V={V} T={T} C={C} F={F} (llama {llama_ffn(args)}) H={H} L={L} "
          f"B={B}; "
          f"threads {args.threads or 'default'}; load average {open('/proc/loadavg').read().split()[:3]}")
    for name, (fn, sync) in runners.items():  # warmup
        for i in range(3):
            fn(i)
        sync()
    pairs = [p for p in (("clgpt-llama", "clgpt-gpt2"), ("clgpt-moe", "clgpt-llama")) if all(n in runners for n in p)]
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
    if "torch" in what:
        torch_rounds(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generation speed: prefill and decode tokens/s of clgpt's Generator (key/value cache on the OpenCL engine)
beside llama.cpp (llama-cpp-python) on the same GGUF, threads and CPU, in alternated pairs of processes.

Decode: `clgpt generate MODEL --prompt P --ignore-eos --max-tokens 200` as the CLI runs it (the same Generator
stream, sampling settings and suppressed end-of-generation tokens), timed from the first token to the last;
llama.cpp as llama-cli's loop runs it (sample, then evaluate the one token), timed the same way. Prefill: one
pass over a prompt of --prefill tokens (random ids), best of the runs.

Each side runs in a process of its own (`--side clgpt|llama`), one after the other, pairs alternated: in one
process llama.cpp's worker threads and PoCL's competed for the cores and each slowed the other. A side's process
builds and warms up first (untimed), then times --runs decodes and reports their median.

    PYTHONPATH=$PWD python bench/bench_generate.py model.gguf --pairs 5 --threads 2 [--devices default,1:0]

--devices: the OpenCL devices clgpt runs on, each as PYOPENCL_CTX takes it (`clgpt devices`), or `default`: the
one `clgpt generate` picks (clgpt.device.opencl.decode_device), which is also what none given means. Needs the test extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def side(a) -> dict:
    """One side's figures: decode tokens/s (median of a.runs) and prefill tokens/s (best)."""
    import numpy as np

    from clgpt.inference.generate import eog_ids
    from clgpt.io.gguf import read_gguf

    cfg, params, tok, kv = read_gguf(a.model)
    eog = sorted(eog_ids(kv))
    prompt = [tok.bos_id, *tok.encode(a.prompt)]
    long_prompt = [tok.bos_id, *np.random.default_rng(0).integers(0, tok.bos_id, a.prefill - 1).tolist()]
    if a.side == "clgpt":
        from clgpt.device.opencl import decode_device
        from clgpt.inference.generate import Generator
        from clgpt.device.knobs import read as read_knobs

        gen = Generator(cfg, params, device=decode_device(), knobs=read_knobs())  # what `clgpt generate` takes

        def decode(seed):
            stream = gen.stream(prompt, a.max_tokens, seed=seed, suppress_ids=eog, temperature=0.8, top_k=40,
                                top_p=0.95)
            next(stream)
            t0 = time.perf_counter()
            n = sum(1 for _ in stream)
            return n / (time.perf_counter() - t0)

        def prefill():
            t0 = time.perf_counter()
            gen.prefill(long_prompt)
            return len(long_prompt) / (time.perf_counter() - t0)

        device = gen.engine.dev.name
    else:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=a.model, n_ctx=cfg.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                              verbose=False, seed=0)

        def suppress(_, logits):
            logits[eog] = -np.inf
            return logits

        processors = llama_cpp.LogitsProcessorList([suppress])

        def decode(seed):
            llm.reset()
            llm.set_seed(seed)
            llm.eval(prompt)
            t0 = time.perf_counter()
            for _ in range(a.max_tokens - 1):
                llm.eval([llm.sample(top_k=40, top_p=0.95, min_p=0.0, temp=0.8, repeat_penalty=1.0,
                                     logits_processor=processors)])
            return (a.max_tokens - 1) / (time.perf_counter() - t0)

        def prefill():
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(long_prompt)
            return len(long_prompt) / (time.perf_counter() - t0)

        device = f"llama.cpp, {a.threads} threads"
    decode(0), prefill()  # warm: kernel builds, caches
    runs = [decode(k + 1) for k in range(a.runs)]
    return dict(decode=statistics.median(runs), prefill=max(prefill() for _ in range(a.runs)), device=device,
                arch=cfg.arch, C=cfg.n_embd, L=cfg.n_layer, V=cfg.vocab_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill measurement")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="decodes a side's process times")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--devices", default="default", help="comma-separated PYOPENCL_CTX values for clgpt, or default")
    ap.add_argument("--side", choices=("clgpt", "llama"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        print(json.dumps(side(a)))
        return 0
    devices = [None if d == "default" else d for d in a.devices.split(",") if d] or [None]
    env = dict(os.environ, POCL_MAX_PTHREAD_COUNT=str(a.threads))  # PoCL's CPU threads, as llama.cpp's

    def run(name, device=None):
        e = dict(env, **({"PYOPENCL_CTX": device} if device else {}))
        cmd = [sys.executable, __file__, a.model, "--side", name, "--prompt", a.prompt, "--max-tokens",
               str(a.max_tokens), "--prefill", str(a.prefill), "--runs", str(a.runs), "--threads", str(a.threads)]
        out = subprocess.run(cmd, env=e, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    rows = []  # per pair: {device: clgpt figures}, llama.cpp figures
    for k in range(a.pairs):
        ours = {d: run("clgpt", d) for d in devices}
        peer = run("llama")
        rows.append((ours, peer))
        print(f"pair {k + 1}: " + "  ".join(f"clgpt {o['device']} {o['decode']:8.1f} tok/s" for o in ours.values())
              + f"  llama.cpp {peer['decode']:8.1f}", file=sys.stderr)
    first = rows[0][1]
    print(f"model {a.model}: {first['arch']}, C {first['C']}, L {first['L']}, V {first['V']}, {a.threads} threads, "
          f"{a.max_tokens} tokens, median of {a.pairs} pairs (each side's process: median of {a.runs} decodes)")
    print("| clgpt on | clgpt decode tok/s | llama.cpp decode tok/s | clgpt / llama.cpp (range) | prefill ratio (best) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for d in devices:
        ratios = [o[d]["decode"] / p["decode"] for o, p in rows]
        pre = max(o[d]["prefill"] for o, _ in rows) / max(p["prefill"] for _, p in rows)
        print(f"| {rows[0][0][d]['device']} | {statistics.median(o[d]['decode'] for o, _ in rows):,.0f} | "
              f"{statistics.median(p['decode'] for _, p in rows):,.0f} | **{statistics.median(ratios):.3f}** "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {pre:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

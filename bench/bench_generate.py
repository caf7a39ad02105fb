"""Generation speed: prefill and decode tokens/s of clgpt's Generator (key/value cache on the OpenCL engine)
beside llama.cpp (llama-cpp-python) on the same GGUF, threads and CPU, in alternated pairs in one process.

Decode: `clgpt generate MODEL --prompt P --ignore-eos --max-tokens 200` as the CLI runs it (the same Generator
stream, sampling settings and suppressed end-of-generation tokens), timed from the first token to the last;
llama.cpp's `create_completion` with the same settings, streamed and timed the same way. Prefill: one pass over
a prompt of --prefill tokens (held-out text), best of the pairs.

    PYTHONPATH=$PWD python bench/bench_generate.py model.gguf --pairs 5 --threads 2

Needs the test extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill measurement")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", str(a.threads))  # PoCL's CPU threads, as llama.cpp's
    import llama_cpp
    import numpy as np

    from clgpt.generate import Generator, eog_ids
    from clgpt.io.gguf import read_gguf

    cfg, params, tok, kv = read_gguf(a.model)
    eog = sorted(eog_ids(kv))
    gen = Generator(cfg, params)
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=cfg.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          verbose=False, seed=0)
    prompt = [tok.bos_id, *tok.encode(a.prompt)]
    rng = np.random.default_rng(0)
    long_prompt = [tok.bos_id, *rng.integers(0, tok.bos_id, a.prefill - 1).tolist()]
    sampling = dict(temperature=0.8, top_k=40, top_p=0.95)

    def ours_decode(seed):
        stream = gen.stream(prompt, a.max_tokens, seed=seed, suppress_ids=eog, **sampling)
        next(stream)
        t0 = time.perf_counter()
        n = sum(1 for _ in stream)
        return n / (time.perf_counter() - t0)

    def llama_decode(seed):
        stream = llm.create_completion(prompt, max_tokens=a.max_tokens, seed=seed, repeat_penalty=1.0, stream=True,
                                       logit_bias={e: float("-inf") for e in eog}, **sampling)
        next(stream)
        t0 = time.perf_counter()
        n = sum(1 for _ in stream)
        return n / (time.perf_counter() - t0)

    def llama_loop(seed):
        """llama.cpp's decode without llama-cpp-python's completion layer (its streaming took 10 ms a token on
        most seeds here, 0.3 ms on others): sample, then evaluate the one token, as llama-cli's loop does."""
        llm.reset()
        llm.set_seed(seed)
        llm.eval(prompt)

        def suppress(_, logits):
            logits[eog] = -np.inf
            return logits

        t0 = time.perf_counter()
        for _ in range(a.max_tokens - 1):
            llm.eval([llm.sample(top_k=40, top_p=0.95, min_p=0.0, temp=0.8, repeat_penalty=1.0,
                                 logits_processor=llama_cpp.LogitsProcessorList([suppress]))])
        return (a.max_tokens - 1) / (time.perf_counter() - t0)

    def ours_prefill():
        t0 = time.perf_counter()
        gen.prefill(long_prompt)
        return len(long_prompt) / (time.perf_counter() - t0)

    def llama_prefill():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_prompt)
        return len(long_prompt) / (time.perf_counter() - t0)

    ours_decode(0), llama_decode(0), llama_loop(0), ours_prefill(), llama_prefill()  # warm: builds, caches
    rows = []
    for k in range(a.pairs):
        rows.append((ours_decode(k + 1), llama_loop(k + 1), llama_decode(k + 1), ours_prefill(), llama_prefill()))
        o, l, c = rows[-1][:3]
        print(f"pair {k + 1}: decode clgpt {o:8.1f} tok/s  llama.cpp loop {l:8.1f}  completion {c:8.1f}  "
              f"ratio {o / l:.3f}", file=sys.stderr)
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"model {a.model}: {cfg.arch}, C {cfg.n_embd}, L {cfg.n_layer}, V {cfg.vocab_size}, {a.threads} threads")
    print("| | clgpt tok/s | llama.cpp tok/s | clgpt / llama.cpp |")
    print("| --- | ---: | ---: | ---: |")
    for col, what in ((1, "llama.cpp's sample-and-eval loop"), (2, "llama-cpp-python's streamed completion")):
        ratios = [r[0] / r[col] for r in rows]
        print(f"| decode, {a.max_tokens} tokens, against {what} (median of {a.pairs} pairs) | {med[0]:.1f} | "
              f"{med[col]:.1f} | **{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) |")
    print(f"| prefill, {len(long_prompt)} tokens (best) | {max(c[3] for c in rows):.0f} | "
          f"{max(c[4] for c in rows):.0f} | {max(c[3] for c in rows) / max(c[4] for c in rows):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak host memory of the encode stage on a large corpus (issue: 100 MB stays under 1 GiB).

    python bench/encode_memory.py --mb 100

Builds a corpus of the given size from the embedded facts (shuffled words, so the tokenizer's word cache
sees realistic variety), trains the default-size tokenizer on data/, encodes the corpus with the encode
stage's own function and prints the peak resident memory of this process.
"""

import argparse
import os
import resource
import tempfile
import time

import numpy as np

from clgpt.data import corpus_files, encode_text_files, read_text
from clgpt.text.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--vocab-size", type=int, default=1024)
    args = ap.parse_args()
    lines = list(read_text(corpus_files("data/pretrain", ".txt")))
    words = " ".join(lines).split()
    tok = Tokenizer.train(lines, args.vocab_size)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "big.txt")
        target = int(args.mb * 1e6)
        with open(src, "w", encoding="utf-8") as f:
            size = 0
            while size < target:
                picks = rng.integers(0, len(words), size=(10000, 12))
                chunk = "".join(" ".join(words[i] for i in row) + "\n" for row in picks)
                f.write(chunk)
                size += len(chunk.encode())
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        meta = encode_text_files(tok, [src], os.path.join(d, "big.bin"))
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"corpus {size / 1e6:.1f} MB: {meta['n_tokens']:,} tokens, {meta['n_documents']:,} documents in {dt:.1f} s "
          f"({size / 1e6 / dt:.2f} MB/s)")
    print(f"peak RSS {peak:.0f} MiB (before encoding {base:.0f} MiB); limit 1024 MiB: {'OK' if peak < 1024 else 'OVER'}")


if __name__ == "__main__":
    main()

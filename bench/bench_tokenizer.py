"""Tokenizer training and encoding speed against Hugging Face tokenizers on CPython stdlib source.

    python bench/bench_tokenizer.py [--vocab-size 4096] [--max-mb 4.7]

Both trainers see the same texts and the same pre-tokenization (llama.cpp's gpt-2 regex, then bytes);
HF's BpeTrainer starts from the 256-byte alphabet and gets the same 4 special tokens.
"""

import argparse
import pathlib
import sys
import sysconfig
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from clgpt.tokenizer import GPT2_SPLIT_PATTERN, SPECIAL_TOKENS, Tokenizer  # noqa: E402


def stdlib_texts(max_bytes: int) -> list[str]:
    """The stdlib's .py files in sorted order, up to max_bytes of UTF-8."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        n = len(text.encode("utf-8"))
        if total + n > max_bytes:
            text = text.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")
            n = len(text.encode("utf-8"))
        texts.append(text)
        total += n
        if total >= max_bytes:
            break
    return texts


def train_hf(texts: list[str], vocab_size: int):
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    return hf


def main(vocab_size: int = 4096, max_mb: float = 4.7) -> None:
    texts = stdlib_texts(int(max_mb * 1e6))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"corpus: {len(texts)} stdlib .py files, {n_bytes / 1e6:.2f} MB")

    t0 = time.perf_counter()
    tok = Tokenizer.train(texts, vocab_size)
    t_ours = time.perf_counter() - t0
    print(f"clgpt train:        {t_ours:6.2f} s  (vocab {tok.vocab_size})")

    t0 = time.perf_counter()
    hf = train_hf(texts, vocab_size)
    t_hf = time.perf_counter() - t0
    print(f"HF tokenizers train: {t_hf:6.2f} s  (vocab {hf.get_vocab_size()})")
    print(f"ratio clgpt / HF:    {t_ours / t_hf:6.2f}x")

    tok = Tokenizer(tok.merges)  # cold word cache
    t0 = time.perf_counter()
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    t_enc = time.perf_counter() - t0
    print(f"clgpt encode (cold cache): {n_bytes / 1e6 / t_enc:5.2f} MB/s, {n_tokens} tokens, "
          f"{n_bytes / n_tokens:.2f} bytes/token")
    t0 = time.perf_counter()
    for t in texts:
        tok.encode(t)
    t_enc = time.perf_counter() - t0
    print(f"clgpt encode (warm cache): {n_bytes / 1e6 / t_enc:5.2f} MB/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=4.7)
    args = ap.parse_args()
    main(args.vocab_size, args.max_mb)

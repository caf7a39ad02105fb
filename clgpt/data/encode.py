"""The encode stage: the token ids of a text corpus or of dialogs written as X.bin, X.idx and X.json (see
clgpt.data), a held-out split of the stream, optionally by a process pool; and the encoded files read back.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from clgpt.atomic import write_text_atomic
from clgpt.data import corpus
from clgpt.data.corpus import files_sha256, read_dialogs, text_segments
from clgpt.errors import ClgptError
from clgpt.text.chat import encode_chat

ENCODED_VERSION = 2  # 1: document boundaries as a JSON list in the sidecar (still read)
PARALLEL_MIN_BYTES = 8 << 20  # corpora at least this large are encoded by a process pool


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


_worker_tok = None


def _worker_init(tokenizer_path: str) -> None:
    global _worker_tok
    from clgpt.text.tokenizer import Tokenizer

    _worker_tok = Tokenizer.load(tokenizer_path)


def _encode_batch(items: list, tok=None) -> tuple[np.ndarray, np.ndarray]:
    """ids of a batch of items (a str to encode, or an int id), and the offsets of the `<s>` ids in it."""
    tok = tok or _worker_tok
    ids: list[int] = []
    bos = []
    for item in items:
        if isinstance(item, str):
            ids.extend(tok.encode(item))
        else:
            if item == tok.bos_id:
                bos.append(len(ids))
            ids.append(item)
    return np.asarray(ids, dtype=np.int64), np.asarray(bos, dtype=np.int64)


def _batches(segments: Iterable[tuple[str, bool]], tok, batch_chars: int) -> Iterator[list]:
    """Items for _encode_batch: `<s>`, the document's segments, `</s>`; batches of about batch_chars."""
    batch, size, in_doc = [], 0, False
    for seg, end in segments:
        if not in_doc:
            batch.append(tok.bos_id)
            in_doc = True
        if seg:
            batch.append(seg)
            size += len(seg)
        if end:
            batch.append(tok.eos_id)
            in_doc = False
        if size >= batch_chars and not in_doc:
            yield batch
            batch, size = [], 0
        elif size >= batch_chars and len(batch) > 1:
            yield batch  # a long document: its later segments continue in the next batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_batches(batches: Iterable[list], tok, workers: int, tokenizer_path: str | None):
    """(ids, bos offsets) of each batch in order; with workers > 1 a process pool encodes up to
    2 * workers batches ahead, so memory stays bounded."""
    if workers <= 1 or tokenizer_path is None:
        for b in batches:
            yield _encode_batch(b, tok)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, initializer=_worker_init, initargs=(tokenizer_path,)) as pool:
        pending: deque = deque()
        for b in batches:
            pending.append(pool.submit(_encode_batch, b))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def default_workers(files: Iterable[str]) -> int:
    """Processes for encoding: every core this process may use, once the corpus is PARALLEL_MIN_BYTES."""
    total = sum(os.path.getsize(p) for p in files)
    if total < PARALLEL_MIN_BYTES:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


class _EncodedWriter:
    """Streams ids to X.bin and document starts to X.idx, both under temporary names."""

    def __init__(self, out_bin: str, dtype: np.dtype):
        self.out_bin, self.dtype = out_bin, dtype
        self.tmp_bin, self.tmp_idx = out_bin + ".tmp", index_path(out_bin) + ".tmp"
        self.f_bin, self.f_idx = open(self.tmp_bin, "wb"), open(self.tmp_idx, "wb")
        self.n_tokens = self.n_documents = 0

    def write(self, ids: np.ndarray, starts: np.ndarray) -> None:
        self.f_bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.f_idx.write((np.asarray(starts, dtype=np.uint64) + np.uint64(self.n_tokens)).tobytes())
        self.n_tokens += len(ids)
        self.n_documents += len(starts)

    def close(self) -> None:
        self.f_idx.write(np.asarray([self.n_tokens], dtype=np.uint64).tobytes())
        self.f_bin.close()
        self.f_idx.close()

    def discard(self) -> None:
        for f in (self.f_bin, self.f_idx):
            f.close()
        for p in (self.tmp_bin, self.tmp_idx):
            if os.path.exists(p):
                os.remove(p)


def _sidecar(tok, n_tokens: int, n_documents: int, meta: dict) -> dict:
    return {"version": ENCODED_VERSION, "dtype": _dtype_for(tok.vocab_size).name, "n_tokens": n_tokens,
            "n_documents": n_documents, "vocab_size": tok.vocab_size, "tokenizer_hash": tok.hash(), **meta}


def _publish(tmp_bin: str, tmp_idx: str, out_bin: str, sidecar: dict) -> None:
    """Rename the finished files into place: the id file last, so a reader that sees it sees the rest."""
    write_text_atomic(sidecar_path(out_bin), json.dumps(sidecar, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp_idx, index_path(out_bin))
    os.replace(tmp_bin, out_bin)


def encode_text_files(tok, files: list[str], out_bin: str, *, document: str = "line", separator: str | None = None,
                      heldout_bin: str | None = None, val_fraction: float = 0.0, workers: int = 1,
                      tokenizer_path: str | None = None, where: str | None = None) -> dict:
    """Encode text documents as `<s> text </s>` each, streaming (see the module docstring).

    With `heldout_bin`, the last `val_fraction` of the token stream goes there instead (nanoGPT's split:
    the first int(n * (1 - val_fraction)) tokens train). `workers` > 1 encodes in a process pool, which
    loads the tokenizer from `tokenizer_path`; the ids are the same either way. Returns the sidecar
    (of the training part when split)."""
    dtype = _dtype_for(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(out_bin)), exist_ok=True)
    w = _EncodedWriter(out_bin, dtype)
    try:
        segments = text_segments(files, document, separator)
        items = _batches(segments, tok, corpus.SEGMENT_CHARS)  # corpus's: one value for text_segments and here
        for ids, starts in _encoded_batches(items, tok, workers, tokenizer_path):
            w.write(ids, starts)
        w.close()
    except BaseException:
        w.discard()
        raise
    meta = {"kind": "text", "document": document, "source_sha256": files_sha256(files)}
    if w.n_tokens == 0:
        w.discard()
        raise ClgptError(
            f"{where or ', '.join(files)}: no text to train on (every file is empty or whitespace); add text"
        )
    if heldout_bin is None:
        side = _sidecar(tok, w.n_tokens, w.n_documents, meta)
        _publish(w.tmp_bin, w.tmp_idx, out_bin, side)
        return side
    return _split_encoded(w, tok, out_bin, heldout_bin, val_fraction, meta, where or ", ".join(files))


def _split_encoded(w: _EncodedWriter, tok, out_bin: str, heldout_bin: str, val_fraction: float, meta: dict,
                   where: str) -> dict:
    """Move the last val_fraction of a just-written stream to heldout_bin; truncate the rest."""
    n = w.n_tokens
    cut = int(n * (1.0 - val_fraction))
    if cut < 2 or n - cut < 2:
        w.discard()
        raise ClgptError(
            f"{where}: {n} tokens cannot be split by corpus.val_fraction={val_fraction} (both parts need 2 tokens); "
            "add text, change val_fraction or give corpus.pretrain_heldout"
        )
    try:
        starts = np.fromfile(w.tmp_idx, dtype=np.uint64)[:-1].astype(np.int64)
        ids = np.memmap(w.tmp_bin, dtype=w.dtype, mode="r")
        h = _EncodedWriter(heldout_bin, w.dtype)
        try:
            held_starts = starts[starts >= cut] - cut
            if not len(held_starts) or held_starts[0] != 0:  # the cut fell inside a document
                held_starts = np.concatenate([[0], held_starts])
            for a in range(cut, n, 1 << 24):
                b = min(n, a + (1 << 24))
                h.write(ids[a:b], held_starts[(held_starts >= a - cut) & (held_starts < b - cut)] - (a - cut))
            h.close()
        except BaseException:
            h.discard()
            raise
        del ids
        train_starts = starts[starts < cut]
        with open(w.tmp_bin, "r+b") as f:
            f.truncate(cut * w.dtype.itemsize)
        with open(w.tmp_idx, "wb") as f:
            f.write(np.concatenate([train_starts, [cut]]).astype(np.uint64).tobytes())
        split = {"val_fraction": val_fraction, "split_at": cut, "of_tokens": n}
        held_side = _sidecar(tok, n - cut, len(held_starts), {**meta, "split": {**split, "part": "heldout"}})
        side = _sidecar(tok, cut, len(train_starts), {**meta, "split": {**split, "part": "train"}})
        _publish(h.tmp_bin, h.tmp_idx, heldout_bin, held_side)
        _publish(w.tmp_bin, w.tmp_idx, out_bin, side)
        return side
    finally:
        w.discard()


def encode_dialogs(tok, dialogs: list[dict], out_bin: str, max_len: int, source_sha256: str) -> dict:
    """Encode conversations in the chat format; refuse (naming file and line) one longer than `max_len`.
    The index holds the dialog starts, the end, then each dialog's first loss position (the target of the
    position is its first reply token). The sidecar's `loss_spans[d]` lists the [a, b) target ranges of
    dialog d (relative to its start) that the loss counts: every assistant reply and its end-of-turn token."""
    dtype = _dtype_for(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(out_bin)), exist_ok=True)
    w = _EncodedWriter(out_bin, dtype)
    first_loss, loss_spans = [], []
    try:
        for d in dialogs:
            try:
                ids, spans = encode_chat(tok, d["messages"])
            except ClgptError as e:
                raise ClgptError(f"{d['source']}: {e}") from None
            if len(ids) > max_len:
                raise ClgptError(
                    f"{d['source']}: dialog is {len(ids)} tokens, longer than the context of {max_len}; "
                    "shorten it or raise model.n_ctx"
                )
            first_loss.append(w.n_tokens + spans[0][0])
            loss_spans.append([list(span) for span in spans])
            w.write(np.asarray(ids), np.asarray([0]))
        w.close()
        with open(w.tmp_idx, "ab") as f:
            f.write(np.asarray(first_loss, dtype=np.uint64).tobytes())
        side = _sidecar(tok, w.n_tokens, w.n_documents, {"kind": "dialog", "source_sha256": source_sha256,
                                                         "loss_spans": loss_spans})
        _publish(w.tmp_bin, w.tmp_idx, out_bin, side)
        return side
    finally:
        w.discard()


def encode_dialog_files(tok, files: list[str], out_bin: str, max_len: int) -> dict:
    """Encode the dialogs of JSON Lines files (see encode_dialogs)."""
    return encode_dialogs(tok, read_dialogs(files), out_bin, max_len, files_sha256(files))


def sidecar_path(bin_path: str) -> str:
    return str(Path(bin_path).with_suffix(".json"))


def index_path(bin_path: str) -> str:
    return str(Path(bin_path).with_suffix(".idx"))


def load_encoded(path: str) -> tuple[np.ndarray, dict]:
    """(ids as a read-only memmap, sidecar dict) of an encoded `.bin` file."""
    side = sidecar_path(path)
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ClgptError(f"{side}: cannot read the encoded file's sidecar ({e}); re-run the encode stage") from None
    if not isinstance(meta, dict) or meta.get("version") not in (1, ENCODED_VERSION):
        raise ClgptError(f"{side}: unknown sidecar version; re-run the encode stage")
    dtype = np.dtype(meta["dtype"])
    size = os.path.getsize(path) if os.path.exists(path) else -1
    if size != meta["n_tokens"] * dtype.itemsize:
        raise ClgptError(f"{path}: size does not match its sidecar ({meta['n_tokens']} tokens); re-run the encode stage")
    if meta["n_tokens"] == 0:
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(path, dtype=dtype, mode="r"), meta


def load_documents(path: str, meta: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """(bounds, first loss positions) of an encoded file: bounds int64 (n_documents + 1,), document d is
    ids[bounds[d]:bounds[d+1]]; for dialogs int64 (n_documents,) the position whose target is each dialog's
    first reply token (the `<|im_start|>assistant\n` header's last token; all spans: sidecar `loss_spans`),
    else None."""
    n = int(meta["n_documents"])
    if meta.get("version") == 1:  # boundaries in the sidecar
        docs = meta.get("documents") or []
        bounds = np.asarray([d[0] for d in docs] + [meta["n_tokens"]], dtype=np.int64)
        pos = meta.get("assistant_pos")
        return bounds, (np.asarray(pos, dtype=np.int64) if pos is not None else None)
    idx = index_path(path)
    try:
        raw = np.fromfile(idx, dtype=np.uint64).astype(np.int64)
    except OSError as e:
        raise ClgptError(f"{idx}: cannot read the document index ({e.strerror}); re-run the encode stage") from None
    dialog = meta.get("kind") == "dialog"
    if len(raw) != n + 1 + (n if dialog else 0) or (n and raw[n] != meta["n_tokens"]):
        raise ClgptError(f"{idx}: does not match its sidecar ({n} documents); re-run the encode stage")
    return raw[: n + 1], (raw[n + 1 :] if dialog else None)

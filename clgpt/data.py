"""The corpus: reading and checking it, the encode stage, and reading encoded token files back.

Text corpus: UTF-8 files, one document (a short statement) per non-blank line.
Dialogs: JSON Lines, one `{"user": "...", "assistant": "..."}` per line.
Encoded files: a flat `uint16` (`uint32` when the vocabulary needs it) id file `X.bin` and a JSON sidecar
`X.json` with the tokenizer hash, counts and document boundaries; read back with `np.memmap`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from clgpt.atomic import atomic_path, write_text_atomic
from clgpt.chat import encode_dialog
from clgpt.errors import ClgptError

ENCODED_VERSION = 1


def corpus_files(folder: str, suffix: str) -> list[str]:
    """The `*.suffix` files of a folder, sorted; an error when there are none."""
    path = Path(folder)
    if not path.is_dir():
        raise ClgptError(f"{folder}: corpus folder does not exist; create it or fix the path in config.yaml")
    files = sorted(str(p) for p in path.glob(f"*{suffix}") if p.is_file() and not p.name.startswith("."))  # ._x (macOS)
    if not files:
        raise ClgptError(f"{folder}: no *{suffix} files; add at least one or fix the path in config.yaml")
    return files


def _utf8_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its ending) of a UTF-8 file, streamed: memory stays bounded by the
    longest line, and a decoding error names the byte offset in the file."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ClgptError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        offset = 0
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ClgptError(
                    f"{path}: not UTF-8 at byte offset {offset + e.start} (line {n}); re-save the file as UTF-8"
                ) from None
            offset += len(raw)
            if n == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not text
            yield n, line.rstrip("\r\n")


def read_text(files: Iterable[str]) -> Iterator[str]:
    """Documents of text files: one per non-blank line, stripped of its line ending."""
    for path in files:
        for _, line in _utf8_lines(path):
            if line.strip():
                yield line


def read_dialogs(files: Iterable[str]) -> list[dict]:
    """Dialogs of JSON Lines files, each `{"user": str, "assistant": str}`; errors name file and line."""
    dialogs = []
    for path in files:
        for n, line in _utf8_lines(path):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ClgptError(f"{path}:{n}: not valid JSON ({e.msg}); write one JSON object per line") from None
            if not isinstance(d, dict):
                raise ClgptError(f'{path}:{n}: expected an object {{"user": ..., "assistant": ...}}')
            for key in ("user", "assistant"):
                if not isinstance(d.get(key), str) or not d[key].strip():
                    raise ClgptError(f'{path}:{n}: missing or empty "{key}" field; each line needs "user" and "assistant" strings')
            extra = set(d) - {"user", "assistant"}
            if extra:
                raise ClgptError(f"{path}:{n}: unknown field {sorted(extra)[0]!r}; only \"user\" and \"assistant\" are allowed")
            dialogs.append({"user": d["user"], "assistant": d["assistant"], "source": f"{path}:{n}"})
    if not dialogs:
        raise ClgptError(f"{', '.join(files)}: no dialogs found; add lines like {{\"user\": \"Hi\", \"assistant\": \"Hello!\"}}")
    return dialogs


def files_sha256(files: Iterable[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _write_encoded(out_bin: str, docs: Iterable[list[int]], tok, meta: dict) -> dict:
    """Stream documents' ids to `out_bin` (temp name, then rename) and write the sidecar."""
    dtype = _dtype_for(tok.vocab_size)
    documents, n = [], 0
    with atomic_path(out_bin) as tmp:
        with open(tmp, "wb") as f:
            for ids in docs:
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                documents.append([n, n + len(ids)])
                n += len(ids)
        sidecar = {
            "version": ENCODED_VERSION,
            "dtype": dtype.name,
            "n_tokens": n,
            "n_documents": len(documents),
            "vocab_size": tok.vocab_size,
            "tokenizer_hash": tok.hash(),
            **meta,
            "documents": documents,
        }
        write_text_atomic(sidecar_path(out_bin), json.dumps(sidecar, indent=1, ensure_ascii=False))
    return sidecar


def encode_text_files(tok, files: list[str], out_bin: str) -> dict:
    """Encode text documents as `<s> text </s>` each."""
    docs = ([tok.bos_id, *tok.encode(line), tok.eos_id] for line in read_text(files))
    return _write_encoded(out_bin, docs, tok, {"kind": "text", "source_sha256": files_sha256(files)})


def encode_dialog_files(tok, files: list[str], out_bin: str, max_len: int) -> dict:
    """Encode dialogs in the chat format; refuse (naming file and line) one longer than `max_len`."""
    dialogs = read_dialogs(files)
    assistant_pos, n = [], 0

    def docs():
        nonlocal n
        for d in dialogs:
            ids, start = encode_dialog(tok, d["user"], d["assistant"])
            if len(ids) > max_len:
                raise ClgptError(
                    f"{d['source']}: dialog is {len(ids)} tokens, longer than the context of {max_len}; "
                    "shorten it or raise model.n_ctx"
                )
            assistant_pos.append(n + start)
            n += len(ids)
            yield ids

    meta = {"kind": "dialog", "source_sha256": files_sha256(files), "assistant_pos": assistant_pos}
    return _write_encoded(out_bin, docs(), tok, meta)


def sidecar_path(bin_path: str) -> str:
    return str(Path(bin_path).with_suffix(".json"))


def load_encoded(path: str) -> tuple[np.ndarray, dict]:
    """(ids as a read-only memmap, sidecar dict) of an encoded `.bin` file."""
    side = sidecar_path(path)
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ClgptError(f"{side}: cannot read the encoded file's sidecar ({e}); re-run the encode stage") from None
    if not isinstance(meta, dict) or meta.get("version") != ENCODED_VERSION:
        raise ClgptError(f"{side}: unknown sidecar version; re-run the encode stage")
    dtype = np.dtype(meta["dtype"])
    size = os.path.getsize(path) if os.path.exists(path) else -1
    if size != meta["n_tokens"] * dtype.itemsize:
        raise ClgptError(f"{path}: size does not match its sidecar ({meta['n_tokens']} tokens); re-run the encode stage")
    if meta["n_tokens"] == 0:
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(path, dtype=dtype, mode="r"), meta

"""The corpus: reading and checking it, the encode stage, reading encoded token files back, and batching.

Text corpus: a folder of `*.txt` (UTF-8), `*.jsonl` (one `{"text": ...}` per line) and `*.parquet` (a
`text` column) files, the Hugging Face datasets conventions. `corpus.document` says what one document
(`<s> ... </s>` in the token stream) is:
  file       a whole .txt file, or one jsonl/parquet record; newlines kept; `corpus.separator` (e.g.
             `<|endoftext|>`) splits it further, TinyStories style (each part stripped of surrounding
             whitespace);
  paragraph  the runs of non-blank lines, split at blank lines (newlines inside a paragraph kept);
  line       each non-blank line (the embedded fact corpus).
Texts are read in chunks of CHUNK_CHARS and encoded in segments cut where the pre-tokenizer would cut
anyway, so memory stays bounded on any file and the ids equal those of encoding the text whole.
Dialogs: JSON Lines, one conversation per line: `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"user": "...", "assistant": "..."}` (clgpt.chat.parse_dialog_line checks both).
Encoded files: a flat `uint16` (`uint32` when the vocabulary needs it) id file `X.bin`, a binary index
`X.idx` (uint64: the start of every document, then the end of the stream; for dialogs followed by the
position whose target is every dialog's first reply token) and a small JSON sidecar `X.json` (counts,
hashes; for dialogs `loss_spans`, every assistant turn's target ranges);
read back with `np.memmap`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import regex

from clgpt.atomic import atomic_path, write_text_atomic
from clgpt.chat import encode_chat, parse_dialog_line
from clgpt.errors import ClgptError

ENCODED_VERSION = 2  # 1: document boundaries as a JSON list in the sidecar (still read)
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DOCUMENT_MODES = ("file", "paragraph", "line")
CHUNK_CHARS = 1 << 20  # characters read at a time from a text file
SEGMENT_CHARS = 1 << 18  # characters encoded as one piece of work
MAX_CARRY_CHARS = 1 << 22  # text with no safe cut point is cut here anyway (pre-tokens may then differ)
PARALLEL_MIN_BYTES = 8 << 20  # corpora at least this large are encoded by a process pool
# A space before a letter, after a non-space: the gpt-2 pre-tokenizer always starts a word there, and
# nothing before it depends on what follows, so text cut here encodes as the whole text does.
_SAFE_CUT = regex.compile(r"(?<=\S) (?=\p{L})")
_BLANK_LINE = regex.compile(r"\n[ \t\f\v\r]*\n")


def corpus_files(folder: str, suffix: str | tuple[str, ...]) -> list[str]:
    """The `*.suffix` files of a folder (suffix: one or a tuple), sorted; an error when there are none."""
    path = Path(folder)
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    pattern = " / ".join(f"*{x}" for x in suffixes)
    if not path.is_dir():
        raise ClgptError(f"{folder}: corpus folder does not exist; create it or fix the path in config.yaml")
    files = sorted(str(p) for p in path.iterdir()
                   if p.is_file() and p.name.endswith(suffixes) and not p.name.startswith("."))  # ._x (macOS)
    if not files:
        raise ClgptError(f"{folder}: no {pattern} files; add at least one or fix the path in config.yaml")
    return files


def text_corpus_files(folder: str) -> list[str]:
    """The pretraining text files of a folder: *.txt, *.jsonl, *.parquet."""
    return corpus_files(folder, TEXT_SUFFIXES)


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


def _jsonl_records(path: str, shape: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSON Lines file; a line that is not JSON is
    an error naming file and line and the `shape` each line should have."""
    for n, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ClgptError(f"{path}:{n}: not valid JSON ({e.msg}); write one {shape} per line") from None


def read_dialogs(files: Iterable[str]) -> list[dict]:
    """Conversations of JSON Lines files, each {"messages": [{"role", "content"}, ...], "source": "file:line"};
    errors name file and line."""
    dialogs = []
    for path in files:
        for n, d in _jsonl_records(path, "JSON object"):
            dialogs.append(parse_dialog_line(d, f"{path}:{n}"))
    if not dialogs:
        raise ClgptError(f"{', '.join(files)}: no dialogs found; add lines like "
                         '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}')
    return dialogs


def dialog_texts(dialogs: Iterable[dict]) -> Iterator[str]:
    """The ordinary-text pieces the chat format encodes (`role\ncontent` and the "\n" between messages),
    for training the tokenizer on what it will see."""
    for d in dialogs:
        for m in d["messages"]:
            yield f"{m['role']}\n{m['content']}"
            yield "\n"


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


# ---- text sources: each yields texts, a text being an iterator of string chunks -------------------

def _txt_chunks(path: str) -> Iterator[str]:
    """A UTF-8 file in chunks of about CHUNK_CHARS characters, a leading BOM dropped, CRLF read as LF;
    a decoding error names the byte offset."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ClgptError(f"{path}: cannot read ({e.strerror})") from None
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset, first, held_cr = 0, True, ""
    with f:
        while True:
            raw = f.read(CHUNK_CHARS)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise ClgptError(
                    f"{path}: not UTF-8 at byte offset {offset + e.start}; re-save the file as UTF-8"
                ) from None
            offset += len(raw)
            if first and text:
                text, first = text.removeprefix("\ufeff"), False
            text = held_cr + text
            held_cr = ""
            if raw and text.endswith("\r"):
                text, held_cr = text[:-1], "\r"
            text = text.replace("\r\n", "\n")
            if text:
                yield text
            if not raw:
                return


def _jsonl_texts(path: str) -> Iterator[tuple[str, str]]:
    """(where, text) of each record of a pretraining JSON Lines file; a record without a string "text"
    field is an error naming file and line."""
    for n, d in _jsonl_records(path, '{"text": "..."} object'):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise ClgptError(
                f'{path}:{n}: no "text" string field; each line of a pretraining .jsonl file needs {{"text": "..."}}'
            )
        yield f"{path}:{n}", d["text"]


def _parquet_column(path: str):
    """The pyarrow ParquetFile of `path`, checked to have a string `text` column."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ClgptError(f"{path}: reading .parquet needs pyarrow; pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own exception types for a bad file
        raise ClgptError(f"{path}: not a readable parquet file ({e}); re-export it") from None
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ClgptError(
            f"{path}: no 'text' column (columns: {', '.join(names) or 'none'}); pretraining parquet files need a "
            "string column named text"
        )
    import pyarrow as pa

    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ClgptError(f"{path}: column 'text' holds {kind}, not strings; store the documents as strings")
    return pf


def _parquet_texts(path: str) -> Iterator[tuple[str, str]]:
    """(where, text) of each non-null row of a parquet file's `text` column, read a row group at a time."""
    pf = _parquet_column(path)
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=["text"]):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is not None:
                yield f"{path}: row {row}", value


def _chunked(text: str) -> Iterator[str]:
    for i in range(0, len(text), CHUNK_CHARS):
        yield text[i : i + CHUNK_CHARS]


def _texts(path: str) -> Iterator[Iterator[str]]:
    """The texts of one corpus file, each as an iterator of chunks (consume each before the next)."""
    if path.endswith(".jsonl"):
        for _, text in _jsonl_texts(path):
            yield _chunked(text)
    elif path.endswith(".parquet"):
        for _, text in _parquet_texts(path):
            yield _chunked(text)
    else:
        yield _txt_chunks(path)


# ---- documents ---------------------------------------------------------------------------------
# A document stream is a flat iterator of (piece, end): the pieces of one document in order, the last
# one with end=True. Pieces are at most about CHUNK_CHARS long; no document is empty or only whitespace.

def _split_stream(chunks: Iterable[str], sep) -> Iterator[tuple[str, bool]]:
    """Pieces of the parts of a chunked text split at `sep` (a str, or a compiled pattern whose matches
    are no longer than a line), end=True closing each part; parts are not yet stripped."""
    carry = ""
    for chunk in chunks:
        buf = carry + chunk
        pos = 0
        literal = isinstance(sep, str)
        for a, b in (_find_all(buf, sep) if literal else (m.span() for m in sep.finditer(buf))):
            if not literal and b >= len(buf):  # might extend into the next chunk
                break
            yield buf[pos:a], True
            pos = b
        tail = buf[pos:]
        keep = _tail_keep(tail, sep)
        if len(tail) - keep > 0:
            yield tail[: len(tail) - keep], False
        carry = tail[len(tail) - keep :]
    yield carry, True


def _find_all(buf: str, sep: str):
    i = buf.find(sep)
    while i != -1:
        yield i, i + len(sep)
        i = buf.find(sep, i + len(sep))


def _tail_keep(tail: str, sep) -> int:
    """How many characters at the end of `tail` may start a separator: kept for the next chunk."""
    if isinstance(sep, str):
        return min(len(tail), len(sep) - 1)
    body = len(tail.rstrip())  # a blank-line run starts at a newline and holds only whitespace
    k = tail.find("\n", body)
    return len(tail) - k if k != -1 else 0


def _strip_documents(parts: Iterable[tuple[str, bool]], strip: bool) -> Iterator[tuple[str, bool]]:
    """Drop the parts that are empty or only whitespace; with `strip`, strip each part's ends (leading
    whitespace dropped as it comes, trailing whitespace held back until more text follows)."""
    started, held = False, ""
    for piece, end in parts:
        if not started:
            lead = piece.lstrip()
            if lead:
                started = True
                piece = lead if strip else held + piece
                held = ""
            elif not strip:
                held += piece
        if started:
            if strip:
                body = piece.rstrip()
                if body:
                    out, held = held + body, piece[len(body) :]
                else:
                    out, held = "", held + piece
            else:
                out = piece
            if end:
                yield out, True
                started, held = False, ""
            elif out:
                yield out, False
        elif end:
            held = ""


def document_stream(files: Iterable[str], document: str = "file", separator: str | None = None
                    ) -> Iterator[tuple[str, bool]]:
    """(piece, end of document) of every document of the text files, in file order (see the module
    docstring for the modes). Memory is bounded by the chunk size, whatever the file or document size."""
    if document not in DOCUMENT_MODES:
        raise ClgptError(f"corpus.document={document!r}: use one of {', '.join(DOCUMENT_MODES)}")
    if separator is not None and document != "file":
        raise ClgptError(f"corpus.separator works with corpus.document: file, not {document!r}; remove one of them")
    for path in files:
        if document == "line" and path.endswith(".txt"):
            for _, line in _utf8_lines(path):  # as the fact corpus was always read: its bytes stay the same
                if line.strip():
                    yield line, True
            continue
        for chunks in _texts(path):
            if document == "file" and separator is None:
                yield from _strip_documents(_whole(chunks), strip=False)
            elif document == "file":
                yield from _strip_documents(_split_stream(chunks, separator), strip=True)
            elif document == "paragraph":
                yield from _strip_documents(_split_stream(chunks, _BLANK_LINE), strip=True)
            else:  # line, inside a jsonl/parquet record
                yield from _strip_documents(_split_stream(chunks, "\n"), strip=False)


def _whole(chunks: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """A chunked text as one part: its chunks, then an empty closing piece."""
    for c in chunks:
        yield c, False
    yield "", True


def read_text(files: Iterable[str], document: str = "line", separator: str | None = None) -> Iterator[str]:
    """Whole documents of text files as strings (for small corpora and tests; the encoder streams)."""
    parts: list[str] = []
    for piece, end in document_stream(files, document, separator):
        parts.append(piece)
        if end:
            yield "".join(parts)
            parts = []


def text_segments(files: Iterable[str], document: str = "line", separator: str | None = None
                  ) -> Iterator[tuple[str, bool]]:
    """(segment, end of document): document pieces regrouped into segments of about SEGMENT_CHARS, each
    cut where the gpt-2 pre-tokenizer cuts anyway, so encoding segment by segment equals encoding each
    document whole."""
    carry = ""
    for piece, end in document_stream(files, document, separator):
        buf = carry + piece
        carry = ""
        while not end and len(buf) > SEGMENT_CHARS:
            cut = _safe_cut(buf)
            if cut is None:
                break
            yield buf[:cut], False
            buf = buf[cut:]
        if end:
            yield buf, True
        elif len(buf) > MAX_CARRY_CHARS:
            yield buf, False  # no safe cut in 4 M characters: cut anyway (determinism is unaffected)
        else:
            carry = buf


def _safe_cut(buf: str) -> int | None:
    """The last safe cut position in the back half of `buf` past SEGMENT_CHARS / 2, else the first one
    anywhere; None when there is none."""
    lo = max(0, len(buf) - SEGMENT_CHARS)
    m = None
    for m in _SAFE_CUT.finditer(buf, lo):
        pass
    if m is None:
        m = _SAFE_CUT.search(buf, 1)
    return m.start() if m is not None and m.start() > 0 else None


# ---- the corpus checks (parse time) ------------------------------------------------------------

def _has_text(path: str) -> bool:
    """Whether a corpus file holds any non-whitespace text (reads only as far as the first)."""
    if os.path.getsize(path) == 0:
        return False
    if path.endswith(".parquet"):
        return any(t.strip() for _, t in _parquet_texts(path))
    if path.endswith(".jsonl"):
        return any(t.strip() for _, t in _jsonl_texts(path))
    return any(c.strip() for c in _txt_chunks(path))


def _contains(path: str, separator: str) -> bool:
    for chunks in _texts(path):
        tail = ""
        for c in chunks:
            if separator in tail + c:
                return True
            tail = (tail + c)[-(len(separator) - 1) :] if len(separator) > 1 else ""
    return False


def check_text_corpus(folder: str, files: list[str], document: str, separator: str | None,
                      key: str = "corpus.pretrain") -> None:
    """The checks on a text corpus that need its files, run when the workflow is parsed: parquet files
    have a string `text` column, the first record of a .jsonl file has a "text" field, the corpus is not
    empty, a separator occurs at least once. Each error is one line naming the folder or file."""
    if document not in DOCUMENT_MODES:
        raise ClgptError(f"corpus.document={document!r}: use one of {', '.join(DOCUMENT_MODES)}")
    if separator is not None and document != "file":
        raise ClgptError(f"corpus.separator works with corpus.document: file, not {document!r}; remove one of them")
    if separator == "":
        raise ClgptError("corpus.separator is empty; give the string between documents (e.g. <|endoftext|>) or remove it")
    for path in files:
        if path.endswith(".parquet"):
            _parquet_column(path)
        elif path.endswith(".jsonl"):
            next(_jsonl_texts(path), None)
    if not any(_has_text(p) for p in files):
        raise ClgptError(
            f"{folder}: the corpus ({key}) is empty: its {len(files)} file(s) hold no text; add text or point "
            f"{key} at another folder"
        )
    if separator is not None and not any(_contains(p, separator) for p in files):
        raise ClgptError(
            f"{folder}: corpus.separator {separator!r} never occurs in its files; fix the separator, or remove it "
            "to make each file (or record) one document"
        )


def check_corpus(corpus: dict) -> None:
    """Parse-time checks of the corpus section (the pretrain text and its held-out file)."""
    doc, sep = corpus.get("document", "file"), corpus.get("separator")
    check_text_corpus(corpus["pretrain"], text_corpus_files(corpus["pretrain"]), doc, sep)
    if corpus.get("pretrain_heldout"):
        path = corpus["pretrain_heldout"]
        if not os.path.isfile(path):
            raise ClgptError(f"{path}: corpus.pretrain_heldout does not exist; fix the path or remove the key "
                             "to hold out corpus.val_fraction of the corpus")
        check_text_corpus(path, [path], doc, None, key="corpus.pretrain_heldout")


def read_dialogs_split(files: list[str], heldout: str | None, val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(training dialogs, held-out dialogs): the held-out file's, or the last val_fraction of the dialogs."""
    dialogs = read_dialogs(files)
    if heldout:
        return dialogs, read_dialogs([heldout])
    n_val = int(len(dialogs) * val_fraction)
    if n_val < 1 or n_val >= len(dialogs):
        raise ClgptError(
            f"{', '.join(files)}: {len(dialogs)} dialogs cannot be split by corpus.val_fraction={val_fraction}; "
            "add dialogs or give corpus.tune_heldout"
        )
    return dialogs[:-n_val], dialogs[-n_val:]


# ---- encoding ----------------------------------------------------------------------------------

_worker_tok = None


def _worker_init(tokenizer_path: str) -> None:
    global _worker_tok
    from clgpt.tokenizer import Tokenizer

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
        for ids, starts in _encoded_batches(_batches(segments, tok, SEGMENT_CHARS), tok, workers, tokenizer_path):
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


# ---- batches: training ---------------------------------------------------------------------------

class WindowSampler:
    """Random windows of a flat token stream: a row is w[:-1] -> w[1:] for a window w of T+1 tokens."""

    def __init__(self, ids: np.ndarray, rng: np.random.Generator, where: str):
        self.ids, self.rng, self.where = ids, rng, where

    def rows(self, n: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """-> tokens, targets, int32 (n, T)."""
        if len(self.ids) < T + 1:
            raise ClgptError(
                f"{self.where}: only {len(self.ids)} tokens, fewer than seq_len+1={T + 1}; "
                "add text or lower seq_len"
            )
        starts = self.rng.integers(0, len(self.ids) - T, size=n)  # window = ids[s : s+T+1]
        windows = np.stack([np.asarray(self.ids[s : s + T + 1], dtype=np.int32) for s in starts])
        return windows[:, :-1], windows[:, 1:]


class PretrainBatches:
    """Pretrain micro-batches: B random windows of seq_len+1 tokens, every target counts."""

    def __init__(self, ids, settings: dict, where: str):
        self.rng = np.random.default_rng(settings["seed"])
        self.windows = WindowSampler(ids, self.rng, where)
        self.B, self.T = settings["batch_size"], settings["seq_len"]
        self.rows_per_epoch = max(1, len(ids) // self.T)  # epochs: windows that would tile the stream once
        self.n_mix = self.dropped = 0

    def next(self):
        """-> tokens, targets int32 (B, T), mask float32 (B, T), number of real (unpadded) tokens."""
        tokens, targets = self.windows.rows(self.B, self.T)
        return tokens, targets, np.ones(tokens.shape, dtype=np.float32), tokens.size

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


def dialog_rows(ids, meta: dict, where: str, T: int) -> tuple[list[tuple[np.ndarray, list]], int]:
    """[(dialog ids int32, its loss spans [(a, b)]: targets a..b-1 count)] of an encoded dialog file, leaving
    out the dialogs whose first reply starts past T tokens (nothing of them would count); -> (rows, number
    left out)."""
    if meta.get("kind") != "dialog":
        raise ClgptError(f"{where}: not an encoded dialog file (kind {meta.get('kind')!r}); re-run the encode stage")
    bounds, _ = load_documents(where, meta)
    spans_of = meta.get("loss_spans")
    if not isinstance(spans_of, list) or len(spans_of) != len(bounds) - 1:
        raise ClgptError(f"{where}: not an encoded dialog file (no loss spans); re-run the encode stage")
    rows, dropped = [], 0
    for start, end, spans in zip(bounds[:-1], bounds[1:], spans_of):
        doc = np.asarray(ids[start:end], dtype=np.int32)
        if not spans or any(not 0 <= a < b <= len(doc) - 1 for a, b in spans):
            raise ClgptError(f"{where}: loss spans {spans} do not fit their dialog [{start}, {end}); re-run the encode stage")
        if spans[0][0] >= min(len(doc) - 1, T):
            dropped += 1
        else:
            rows.append((doc, [tuple(span) for span in spans]))
    return rows, dropped


PAD_WIDTH = 32  # dialog batches are padded to a multiple of this: few distinct widths, few kernel builds


def pad_dialogs(rows: list[tuple[np.ndarray, list]], T: int):
    """One dialog a row, cut to T tokens and padded to W: the longest row rounded up to a multiple of
    PAD_WIDTH, at most T (on PoCL each new width costs kernel builds).
    -> tokens, targets int32 (n, W); mask float32 (n, W), 1 on the targets of the row's loss spans (every
    assistant reply and its end-of-turn token; an int a instead of spans: targets a to the end); number of
    real tokens. Padding is id 0 with mask 0: causal attention keeps it from reaching the real positions
    before it."""
    width = min(-(-max(len(doc) - 1 for doc, _ in rows) // PAD_WIDTH) * PAD_WIDTH, T)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    targets = np.zeros((len(rows), width), dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    n_real = 0
    for r, (doc, spans) in enumerate(rows):
        L = min(len(doc) - 1, T)
        tokens[r, :L], targets[r, :L] = doc[:L], doc[1 : L + 1]
        for a, b in [(spans, L)] if isinstance(spans, (int, np.integer)) else spans:
            mask[r, a : min(b, L)] = 1.0
        n_real += L
    return tokens, targets, mask, n_real


class DialogBatches:
    """Tune micro-batches: B - n_mix dialogs (see pad_dialogs), shuffled once per epoch; rows run on into
    the next epoch's order so every batch is full. With mix_pretrain, n_mix = round(mix * B) more rows
    are pretrain windows as wide as the dialog rows, every target counting."""

    def __init__(self, ids, meta: dict, settings: dict, where: str, mix_ids=None, mix_where: str = ""):
        self.rng = np.random.default_rng(settings["seed"])
        self.B, self.T = settings["batch_size"], settings["seq_len"]
        self.n_mix = min(self.B - 1, int(round(settings["mix_pretrain"] * self.B)))
        if self.n_mix and mix_ids is None:
            raise ClgptError("tune.mix_pretrain is above 0 but no pretrain data (mix_encoded) was given")
        self.mix = WindowSampler(mix_ids, self.rng, mix_where) if self.n_mix else None
        self.dialogs, self.dropped = dialog_rows(ids, meta, where, self.T)
        if not self.dialogs:
            raise ClgptError(f"{where}: no dialog has its reply within seq_len={self.T} tokens; raise tune.seq_len")
        self.rows_per_epoch = len(self.dialogs)
        self.epoch, self.pos = 0, 0
        self.order = self.rng.permutation(len(self.dialogs))

    def _next_dialog(self) -> tuple[np.ndarray, list]:
        if self.pos == len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self.rng.permutation(len(self.dialogs))
        row = self.dialogs[self.order[self.pos]]
        self.pos += 1
        return row

    def next(self):
        """-> tokens, targets int32 (B, W), mask float32 (B, W), number of real tokens; W <= seq_len."""
        tokens, targets, mask, n_real = pad_dialogs([self._next_dialog() for _ in range(self.B - self.n_mix)], self.T)
        if self.n_mix:
            width = tokens.shape[1]
            mix_tokens, mix_targets = self.mix.rows(self.n_mix, width)
            tokens, targets = np.concatenate([tokens, mix_tokens]), np.concatenate([targets, mix_targets])
            mask = np.concatenate([mask, np.ones(mix_tokens.shape, dtype=np.float32)])
            n_real += mix_tokens.size
        return tokens, targets, mask, n_real

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch, "pos": self.pos, "order": self.order}

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.order = np.asarray(state["order"], dtype=np.int64)


# ---- batches: held-out loss ----------------------------------------------------------------------

def text_batches(ids: np.ndarray, T: int, B: int, max_tokens: int = 0):
    """Consecutive windows covering the stream once: rows of T tokens predicting the next T, batched
    by B; a last shorter window for the remainder. With max_tokens > 0, only ceil(max_tokens / T)
    windows, evenly spaced over the stream. Yields tokens, targets int32 (B', T'), mask."""
    n_windows = (len(ids) - 1) // T
    if max_tokens > 0 and -(-max_tokens // T) < n_windows:
        chosen = np.unique(np.linspace(0, n_windows - 1, -(-max_tokens // T)).round().astype(np.int64))
        rest = 0
    else:
        chosen = np.arange(n_windows)
        rest = len(ids) - 1 - n_windows * T
    for b0 in range(0, len(chosen), B):
        rows = np.stack([np.asarray(ids[w * T : w * T + T + 1], dtype=np.int32) for w in chosen[b0 : b0 + B]])
        yield rows[:, :-1], rows[:, 1:], np.ones((len(rows), T), dtype=np.float32)
    if rest > 0:
        row = np.asarray(ids[n_windows * T :], dtype=np.int32)[None, :]
        yield row[:, :-1], row[:, 1:], np.ones((1, rest), dtype=np.float32)


def dialog_batches(rows: list, T: int, B: int):
    for b0 in range(0, len(rows), B):
        tokens, targets, mask, _ = pad_dialogs(rows[b0 : b0 + B], T)
        yield tokens, targets, mask

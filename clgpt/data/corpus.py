"""Reading and checking the corpus: the text sources (.txt, .jsonl, .parquet) as streams of chunks, documents
and the segments the encode stage encodes, the parse-time checks, and the dialog files with their held-out split.
The package docstring (clgpt.data) says what a document is for each `corpus.document`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import regex

from clgpt.errors import ClgptError
from clgpt.text.chat import parse_dialog_line

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DOCUMENT_MODES = ("file", "paragraph", "line")
CHUNK_CHARS = 1 << 20  # characters read at a time from a text file
SEGMENT_CHARS = 1 << 18  # characters encoded as one piece of work
MAX_CARRY_CHARS = 1 << 22  # text with no safe cut point is cut here anyway (pre-tokens may then differ)
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

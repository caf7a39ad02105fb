"""The corpus checks that need no tokenizer, run when the workflow is parsed (rules/common.smk), so a
wrong path or an empty file stops the run before any stage, with one line naming the config key and the
file, instead of failing late inside a stage (or as Snakemake's MissingInputException)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from clgpt.data.corpus import TEXT_SUFFIXES, _utf8_lines, corpus_files
from clgpt.errors import ClgptError

# corpus key -> the suffix of its files (the folders) or of the file (the held-out sets)
FOLDERS = {"pretrain": TEXT_SUFFIXES, "tune": ".jsonl"}
FILES = {"pretrain_heldout": TEXT_SUFFIXES, "tune_heldout": ".jsonl", "tune_accept": ".json"}


def _has_text(path: str) -> bool:
    """Whether a file has a line that is not blank (reads only up to the first one); parquet files are
    checked by clgpt.data.check_corpus, which reads their text column."""
    if path.endswith(".parquet"):
        return True
    return any(line.strip() for _, line in _utf8_lines(path))


def _suffixes(suffix: str | tuple) -> str:
    """`*.jsonl`, or `*.txt, *.jsonl or *.parquet` for a tuple of suffixes."""
    names = [f"*{s}" for s in ((suffix,) if isinstance(suffix, str) else suffix)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _folder(key: str, folder: str, suffix: str) -> list[str]:
    path = Path(folder)
    if path.is_file():
        raise ClgptError(
            f"corpus.{key}: {folder} is a file; set corpus.{key} to the folder that holds the {_suffixes(suffix)} files "
            f"(e.g. {path.parent.as_posix()})"
        )
    if not path.exists():
        raise ClgptError(f"corpus.{key}: folder {folder} does not exist; create it or fix corpus.{key} in config.yaml")
    warn_skipped_files(folder, suffix)
    try:
        return corpus_files(folder, suffix)
    except ClgptError as e:
        raise ClgptError(f"corpus.{key}: {e}") from None


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def warn_skipped_files(folder: str, suffix: str | tuple) -> None:
    """One warning line for the files of a corpus folder that the stages skip although they look like corpus
    files: a suffix in other letters (`a.TXT` beside `b.txt`: the suffixes are matched exactly) and links to a
    file that does not exist."""
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return
    visible = [p for p in entries if not p.name.startswith(".")]
    cased = [p.name for p in visible if p.name.lower().endswith(suffixes) and not p.name.endswith(suffixes)
             and p.is_file()]
    if cased:
        warn(f"{folder}: {len(cased)} file(s) skipped because their suffix is not written in lower case "
             f"({', '.join(cased[:3])}{', ...' if len(cased) > 3 else ''}); rename them (e.g. to *{suffixes[0]}) "
             "to train on them")
    dangling = [p for p in visible if p.is_symlink() and not p.exists() and p.name.lower().endswith(suffixes)]
    if dangling:
        warn(f"{folder}: {len(dangling)} link(s) to a file that does not exist skipped "
             f"({', '.join(f'{p.name} -> {os.readlink(p)}' for p in dangling[:3])}); fix or remove the link")


def warn_dropped_text(files: list[str], separator: str | None, scan_chars: int = 16 << 20) -> None:
    """Warnings for text the stages drop or cut without an error: parquet rows whose `text` is null, and a
    corpus.separator found inside words (each occurrence ends a document, also in the middle of a word)."""
    for path in files:
        if path.endswith(".parquet"):
            nulls, rows = parquet_null_texts(path)
            if nulls:
                warn(f"{path}: {nulls} of {rows} rows have no text (null in column 'text') and are skipped")
    word = re.compile(r"\w")
    if not separator or not (word.match(separator[0]) or word.match(separator[-1])):
        return
    sep = re.escape(separator)
    inside = re.compile("|".join([*([rf"(?<=\w){sep}"] if word.match(separator[0]) else []),
                                  *([rf"{sep}(?=\w)"] if word.match(separator[-1]) else [])]))
    for path in files:
        count, example = 0, None
        for text in _texts_head(path, scan_chars):  # an occurrence cut by a chunk's end is not counted
            for m in inside.finditer(text):
                count += 1
                if example is None:
                    example = text[max(0, m.start() - 12) : m.end() + 12].replace("\n", " ")
        if count:
            warn(f"{path}: corpus.separator {separator!r} occurs inside words {count} time(s), e.g. "
                 f"{example!r}, and splits the document there too; choose a separator the text never holds "
                 "(e.g. <|endoftext|>)")


def _texts_head(path: str, limit: int):
    """The chunks of a corpus file's texts, up to `limit` characters in all (a parse-time look, not a full read)."""
    from clgpt.data.corpus import _texts

    seen = 0
    for chunks in _texts(path):
        for chunk in chunks:
            yield chunk[: limit - seen]
            seen += len(chunk)
            if seen >= limit:
                return


def parquet_null_texts(path: str) -> tuple[int, int]:
    """(rows whose `text` is null, rows) of a parquet file, from its statistics where it has them."""
    from clgpt.data.corpus import _parquet_column

    pf = _parquet_column(path)
    meta = pf.metadata
    column = pf.schema_arrow.get_field_index("text")
    nulls = 0
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(column).statistics
        if stats is None or not stats.has_null_count:
            return pf.read(columns=["text"]).column(0).null_count, meta.num_rows
        nulls += stats.null_count
    return nulls, meta.num_rows


def _file(key: str, file: str) -> str:
    path = Path(file)
    if path.is_dir():
        raise ClgptError(f"corpus.{key}: {file} is a folder; set corpus.{key} to one file")
    if not path.exists():
        raise ClgptError(f"corpus.{key}: {file} does not exist; create it or fix corpus.{key} in config.yaml")
    return file


def check_corpus(corpus: dict) -> dict[str, list[str]]:
    """{"pretrain": [files], "tune": [files]} of a validated `corpus` section, after checking that every
    folder is a folder, every held-out file a file, and that no file is empty or only whitespace (hidden
    files such as macOS's `._en.txt` are skipped by corpus_files)."""
    files = {key: _folder(key, corpus[key], suffix) if corpus.get(key) else [] for key, suffix in FOLDERS.items()}
    heldout = {key: _file(key, corpus[key]) for key in FILES if corpus.get(key)}
    warn_dropped_text(files["pretrain"], corpus.get("separator") if corpus.get("document", "file") == "file" else None)
    if "pretrain_heldout" in heldout:
        warn_dropped_text([heldout["pretrain_heldout"]], None)
    for key, paths in [*files.items(), *((k, [f]) for k, f in heldout.items())]:
        for path in paths:
            if not _has_text(path):
                raise ClgptError(
                    f"corpus.{key}: {path} is empty (no line with text); add text to it or remove it"
                )
    return files


def check_outputs(files: list[str], folders: list[str]) -> None:
    """Before any job runs (Snakemake deletes a job's outputs first, and a read-only one gives its traceback):
    each output file that exists is a file that can be replaced, and each folder the stages write in (or
    its nearest existing parent) can be written. ClgptError naming the path otherwise."""
    import os

    for file in files:
        if os.path.isdir(file):
            raise ClgptError(f"{file} is a folder, where the workflow writes a file of that name; move or rename "
                             "the folder and run again")
        if os.path.lexists(file) and not os.access(file, os.W_OK):
            raise ClgptError(f"{file} is read-only, and the workflow replaces it; make it writable "
                             "(chmod u+w, or chattr -i) or move it away, and run again")
    for folder in dict.fromkeys([*folders, *(os.path.dirname(f) or "." for f in files)]):
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise ClgptError(f"{folder} is a file, where the workflow writes a folder of that name; move or rename "
                             "the file and run again")
        probe = folder
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe) or "."
        if not os.access(probe, os.W_OK | os.X_OK):
            what = "in it" if folder == probe else f"{folder} in it"
            raise ClgptError(f"{probe}: this folder is read-only, and the workflow writes {what}; make it writable "
                             "(chmod u+w, or chattr -i) or run in a writable copy of the project")


FUTURE_SLACK_S = 2.0  # a file system's timestamps may run this far ahead of this host's clock (NFS)


def check_dates(paths: list[str], now: float | None = None) -> None:
    """Before any job: no input is dated in the future. Snakemake marks each output with the time it is
    written and fails a job whose output is older than an input, so an input from the future (a clock that
    was wrong, an archive from another machine) fails every later run. ClgptError naming the newest one."""
    import datetime
    import time

    now = time.time() if now is None else now
    future = []
    for path in paths:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        if mtime > now + FUTURE_SLACK_S:
            future.append((mtime, path))
    if future:
        mtime, path = max(future)
        when = datetime.datetime.fromtimestamp(mtime).strftime("%Y-%m-%d %H:%M:%S")
        more = f" (and {len(future) - 1} more)" if len(future) > 1 else ""
        raise ClgptError(f"{path}{more} is dated in the future ({when}; this machine's clock says "
                         f"{datetime.datetime.fromtimestamp(now):%Y-%m-%d %H:%M:%S}), which would fail every run; "
                         f"run `touch {path}`{' on each' if more else ''} (or fix the clock) and run again")

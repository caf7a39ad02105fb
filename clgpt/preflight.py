"""The corpus checks that need no tokenizer, run when the workflow is parsed (rules/common.smk), so a
wrong path or an empty file stops the run before any stage, with one line naming the config key and the
file, instead of failing late inside a stage (or as Snakemake's MissingInputException)."""

from __future__ import annotations

from pathlib import Path

from clgpt.data import TEXT_SUFFIXES, _utf8_lines, corpus_files
from clgpt.errors import ClgptError

# corpus key -> the suffix of its files (the folders) or of the file (the held-out sets)
FOLDERS = {"pretrain": TEXT_SUFFIXES, "tune": ".jsonl"}
FILES = {"pretrain_heldout": TEXT_SUFFIXES, "tune_heldout": ".jsonl"}


def _has_text(path: str) -> bool:
    """Whether a file has a line that is not blank (reads only up to the first one); parquet files are
    checked by clgpt.data.check_corpus, which reads their text column."""
    if path.endswith(".parquet"):
        return True
    return any(line.strip() for _, line in _utf8_lines(path))


def _folder(key: str, folder: str, suffix: str) -> list[str]:
    path = Path(folder)
    if path.is_file():
        raise ClgptError(
            f"corpus.{key}: {folder} is a file; set corpus.{key} to the folder that holds the *{suffix} files "
            f"(e.g. {path.parent.as_posix()})"
        )
    if not path.exists():
        raise ClgptError(f"corpus.{key}: folder {folder} does not exist; create it or fix corpus.{key} in config.yaml")
    try:
        return corpus_files(folder, suffix)
    except ClgptError as e:
        raise ClgptError(f"corpus.{key}: {e}") from None


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
    for key, paths in [*files.items(), *((k, [f]) for k, f in heldout.items())]:
        for path in paths:
            if not _has_text(path):
                raise ClgptError(
                    f"corpus.{key}: {path} is empty (no line with text); add text to it or remove it"
                )
    return files

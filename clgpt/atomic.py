"""Every output is written to a temporary name beside it and renamed into place, so a reader (a later
stage, a resumed run) sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield `path + ".tmp"` to write to; on success rename it to `path`, on any failure remove it."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

"""Every output is written to a temporary name beside it and renamed into place, so a reader (a later
stage, a resumed run) sees the old file or the new one, never half of one; the folder is fsynced after the
rename, so the new name survives a power cut too.

The files a user keeps (model.gguf, Modelfile, the stages' checkpoints) are written by their stage under
results/staging/ and then published: linked to their own path in one rename (`publish`). Snakemake deletes a
job's declared outputs before the job runs and after it fails; those are the staging copies, so a stage that
fails or is stopped leaves the previous published file as it was."""

from __future__ import annotations

import errno
import os
import shutil
import time
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
        fsync_dir(os.path.dirname(path) or ".")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries to disk: after a rename, a power cut can otherwise still lose it (the new
    file's bytes are on disk, its name is not). Nothing where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a folder (some network ones) has nothing more to give
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def publish(staged: str | os.PathLike, published: str | os.PathLike, mtime_ns: int | None = None) -> None:
    """Put the finished file `staged` at `published` in one rename. A hard link shares the bytes, so the
    published model takes no second copy of disk; where links cannot be made (another file system, a
    file system without them) it is copied.

    The published file is stamped `mtime_ns` (now by default): a link keeps the staged file's time, and
    Snakemake fails a job whose output is older than one of its inputs. Since the two names share one inode,
    a publish job has one output (rules/publish.smk)."""
    staged, published = os.fspath(staged), os.fspath(published)
    mtime_ns = time.time_ns() if mtime_ns is None else mtime_ns
    os.makedirs(os.path.dirname(published) or ".", exist_ok=True)
    with atomic_path(published) as tmp:
        if os.path.lexists(tmp):
            os.remove(tmp)
        try:
            os.link(staged, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            shutil.copyfile(staged, tmp)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing folder); None when unknown."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return None


def disk_full_line(path: str | os.PathLike, needed: int | None = None) -> str:
    """The line for ENOSPC while writing `path`: the file, that the disk is full, and the space needed."""
    free = free_bytes(path)
    room = f"{size_text(free)} free" if free is not None else "no room left"
    need = f"writing it needs about {size_text(needed)} and the disk has {room}" if needed else f"the disk has {room}"
    return (f"{os.fspath(path)}: the disk is full ({need}); free some space on that disk (or move the project "
            "to a larger one) and run the same command again")


def is_disk_full(e: BaseException, path: str | os.PathLike | None = None, needed: int | None = None) -> bool:
    """Whether `e` means the disk is full: ENOSPC (or a quota), or numpy's short write ("N requested and M
    written", no errno) while the disk that holds `path` has less than `needed` bytes free."""
    if not isinstance(e, OSError):
        return False
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    free = free_bytes(path) if path is not None and needed else None
    return e.errno is None and "written" in str(e) and free is not None and free < needed

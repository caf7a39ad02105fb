"""OpenCL runtimes installed from pip, made visible to the ICD loader before it first lists platforms.

Intel's CPU runtime (`intel-opencl-rt`, a dependency on x86-64 Linux and Windows) installs its library into the
environment's prefix, where no ICD loader looks: its own `etc/OpenCL/vendors/intel-cpu.icd` names a build machine's
path. pyopencl's Linux wheel ships ocl-icd, which reads one vendors folder (OCL_ICD_VENDORS, else
/etc/OpenCL/vendors) plus pyopencl's own (PoCL, Oclgrind); it has no OCL_ICD_FILENAMES. So on Linux clgpt writes a
vendors folder of its own, inside the environment where it can (else in the user's cache), holding the system's
.icd files unchanged and one naming Intel's library, and points OCL_ICD_VENDORS at it. On Windows the Khronos loader
takes extra libraries from OCL_ICD_FILENAMES. Child processes (MPI ranks, Snakemake's jobs) inherit the variable.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

SYSTEM_VENDORS = Path("/etc/OpenCL/vendors")


def intel_cpu_library(prefix: Path | None = None) -> Path | None:
    """Intel's CPU runtime in this environment, or None where the wheel is not installed."""
    prefix = Path(prefix or sys.prefix)
    for rel in ("lib/libintelocl.so", "Library/bin/intelocl64.dll"):
        if (prefix / rel).is_file():
            return prefix / rel
    return None


def _vendor_entries(base: Path) -> dict[str, str]:
    """{file name: text} of the .icd files the loader would read from `base` (a folder, or one .icd/library)."""
    if base.is_dir():
        out = {}
        for f in sorted(base.glob("*.icd")):
            try:
                out[f.name] = f.read_text()
            except OSError:  # a dangling link: the loader would skip it too
                continue
        return out
    if base.suffix == ".icd" and base.is_file():
        return {base.name: base.read_text()}
    return {f"{base.name}.icd": f"{base}\n"} if base.is_file() else {}


def _folder_for(entries: dict[str, str], prefix: Path) -> Path:
    """A vendors folder holding exactly `entries`, named by their content so that processes share it."""
    digest = hashlib.sha256(repr(sorted(entries.items())).encode()).hexdigest()[:16]
    roots = [prefix / "etc" / "clgpt" / "opencl-vendors",
             Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clgpt" / "opencl-vendors",
             Path(tempfile.gettempdir()) / f"clgpt-{os.getuid() if hasattr(os, 'getuid') else 0}" / "opencl-vendors"]
    for root in roots:
        folder = root / digest
        if folder.is_dir() and {f.name: f.read_text() for f in folder.glob("*.icd")} == entries:
            return folder
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
            for name, text in entries.items():
                (staging / name).write_text(text)
            try:
                os.replace(staging, folder)  # atomic: a concurrent process sees a whole folder or none
            except OSError:  # another process made it first
                for f in staging.iterdir():
                    f.unlink()
                staging.rmdir()
            return folder
        except OSError:
            continue
    raise OSError("no writable folder for the OpenCL vendors list")


def register_pip_runtimes(env: dict | None = None, prefix: Path | None = None) -> Path | None:
    """Make Intel's pip-installed CPU runtime visible to the loader through `env` (default os.environ); must run
    before pyopencl first lists platforms. Returns the library registered, or None (none installed, or already)."""
    env = os.environ if env is None else env
    lib = intel_cpu_library(prefix)
    if lib is None:
        return None
    if sys.platform == "win32":
        names = [n for n in env.get("OCL_ICD_FILENAMES", "").split(";") if n]
        if str(lib) in names:
            return None
        env["OCL_ICD_FILENAMES"] = ";".join([*names, str(lib)])
        return lib
    base = Path(env.get("OCL_ICD_VENDORS") or SYSTEM_VENDORS)
    entries = _vendor_entries(base)
    if any(text.strip() == str(lib) for text in entries.values()):
        return None
    entries["zz-clgpt-intel-cpu.icd"] = f"{lib}\n"  # a name no system's .icd file has
    try:
        env["OCL_ICD_VENDORS"] = str(_folder_for(entries, Path(prefix or sys.prefix)))
    except OSError:
        return None
    return lib


def separate_pocl_cache(env: dict | None = None, rank: int = 0) -> Path | None:
    """PoCL's kernel cache is not safe for processes that build the same program at once: one of them gets
    BUILD_PROGRAM_FAILURE (pocl/pocl#1480). MPI ranks on one node start and build together, so every rank past 0
    gets a cache folder of its own (kept between runs); rank 0 shares the user's. A POCL_CACHE_DIR the user set is
    left alone. Must run before pyopencl first lists platforms. Returns the folder set, or None."""
    env = os.environ if env is None else env
    if rank <= 0 or env.get("POCL_CACHE_DIR"):
        return None
    folder = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pocl" / f"kcache-rank{rank}"
    env["POCL_CACHE_DIR"] = str(folder)
    return folder


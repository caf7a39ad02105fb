"""clgpt/device/icd.py: Intel's pip-installed CPU runtime made visible to the ICD loader, beside the system's runtimes."""

import sys
from pathlib import Path

from clgpt.device import icd


def _prefix(tmp_path: Path) -> Path:
    lib = tmp_path / "venv" / "lib" / "libintelocl.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    return tmp_path / "venv"


def test_vendors_folder_keeps_the_systems_runtimes_and_adds_intels(tmp_path, monkeypatch):
    prefix = _prefix(tmp_path)
    system = tmp_path / "vendors"
    system.mkdir()
    (system / "pocl.icd").write_text("libpocl.so.2\n")
    (system / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
    monkeypatch.setattr(sys, "prefix", str(prefix))
    env = {"OCL_ICD_VENDORS": str(system)}
    assert icd.register_pip_runtimes(env, prefix) == prefix / "lib" / "libintelocl.so"
    folder = Path(env["OCL_ICD_VENDORS"])
    assert folder != system and folder.is_relative_to(prefix)  # inside the environment, nothing outside it
    assert {f.name: f.read_text() for f in folder.glob("*.icd")} == {
        "pocl.icd": "libpocl.so.2\n", "nvidia.icd": "libnvidia-opencl.so.1\n",
        "zz-clgpt-intel-cpu.icd": f"{prefix / 'lib' / 'libintelocl.so'}\n"}
    again = dict(env)
    assert icd.register_pip_runtimes(again, prefix) is None and again == env  # a child process: already there


def test_nothing_changes_without_the_runtime_and_windows_uses_filenames(tmp_path, monkeypatch):
    env = {}
    assert icd.register_pip_runtimes(env, tmp_path) is None and env == {}
    dll = tmp_path / "Library" / "bin" / "intelocl64.dll"
    dll.parent.mkdir(parents=True)
    dll.write_bytes(b"")
    monkeypatch.setattr(sys, "platform", "win32")
    env = {"OCL_ICD_FILENAMES": "C:\\other.dll"}
    assert icd.register_pip_runtimes(env, tmp_path) == dll
    assert env["OCL_ICD_FILENAMES"] == f"C:\\other.dll;{dll}"


def test_the_loader_lists_intels_runtime_in_this_environment():
    """On x86-64 Linux and Windows the wheel is a dependency, and pyopencl lists its platform through the folder
    clgpt registered; elsewhere it is not installed."""
    import platform

    import pyopencl as cl

    import clgpt.device.opencl  # noqa: F401 - registers before the first listing

    expected = platform.machine() in ("x86_64", "AMD64") and sys.platform in ("linux", "win32")
    assert (icd.intel_cpu_library() is not None) == expected
    if expected:
        assert any("Intel(R) OpenCL" in p.name for p in cl.get_platforms())


def test_mpi_ranks_past_the_first_build_in_a_pocl_cache_of_their_own(tmp_path):
    """Two ranks building the same program in one PoCL cache can fail (pocl/pocl#1480): a rank-1 process builds
    into its own folder, rank 0 into the user's, and a POCL_CACHE_DIR the user set wins."""
    import os
    import subprocess

    script = ("from clgpt.device.opencl import Device, _all_devices, _is_pocl, _probe\n"
              "Device(next(d for _, d in _all_devices() if _is_pocl(d) and not _probe(d))).program('swiglu')\n")
    for rank, preset in ((0, None), (1, None), (1, tmp_path / "mine")):
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / f"cache{rank}{bool(preset)}"), "PMI_RANK": str(rank)}
        env.pop("POCL_CACHE_DIR", None)
        if preset:
            env["POCL_CACHE_DIR"] = str(preset)
        subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=Path(__file__).parent.parent)
        cache = Path(env["XDG_CACHE_HOME"]) / "pocl"
        expected = preset or cache / ("kcache" if rank == 0 else f"kcache-rank{rank}")
        assert expected.is_dir() and any(expected.rglob("*")), expected
        if preset or rank:
            assert not (cache / "kcache").exists()

    env = {}
    assert icd.separate_pocl_cache(env, rank=0) is None and env == {}
    assert icd.separate_pocl_cache(env, rank=2).name == "kcache-rank2" == Path(env["POCL_CACHE_DIR"]).name

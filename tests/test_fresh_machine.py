"""What a new user has: OpenCL from pip alone. The pipeline's pretrain stage runs in a mount namespace where
/etc/OpenCL/vendors is an empty folder (no system OpenCL at all), on the runtimes clgpt's dependencies bring."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from test_errors import one_line_error
from test_pipeline import TINY, make_workdir

SYSTEM_VENDORS = Path("/etc/OpenCL/vendors")


def without_system_opencl(cmd: list[str], cwd: Path, empty: Path) -> subprocess.CompletedProcess:
    """`cmd` in a mount namespace whose /etc/OpenCL/vendors is the empty folder `empty` (where the machine has
    that folder; one that has none already has no system OpenCL)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYOPENCL_CTX", "OCL_ICD_VENDORS", "OCL_ICD_FILENAMES")}
    if SYSTEM_VENDORS.is_dir():
        assert shutil.which("unshare"), "this test needs util-linux's unshare (as root) to hide the system's OpenCL"
        script = f"mount --bind {empty} {SYSTEM_VENDORS} && exec \"$@\""
        cmd = ["unshare", "-m", "sh", "-c", script, "sh", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_pretrain_runs_with_no_system_opencl(tmp_path):
    work = make_workdir(tmp_path / "w", TINY)
    (tmp_path / "empty").mkdir()
    listing = without_system_opencl([sys.executable, "-m", "clgpt", "devices"], work, tmp_path / "empty")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    chosen = [line for line in listing.stdout.splitlines() if line.startswith("*")]
    assert len(chosen) == 1, listing.stdout
    for path in SYSTEM_VENDORS.glob("*.icd") if SYSTEM_VENDORS.is_dir() else ():
        platform = path.read_text().strip()
        assert platform not in listing.stdout  # the namespace really hides the system's runtimes
    r = without_system_opencl([sys.executable, "-m", "snakemake", "--cores", "1", "results/pretrain/model.ckpt"],
                              work, tmp_path / "empty")
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert (work / "results" / "pretrain" / "model.ckpt").stat().st_size > 0


def test_bench_on_a_device_that_cannot_run_our_kernels_is_one_line(monkeypatch, capsys):
    """`clgpt bench --device N:M` naming a device whose compiler fails on our programs: one `error:` line that
    names the device and what to do, and no traceback; on a machine with such a device (PyPI's PoCL on a CPU its
    LLVM does not know), the real one too."""
    from clgpt import cli
    from clgpt.device import opencl as D

    idx, dev = next((i, d) for i, d in D._all_devices() if not D.is_simulator(d))
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    monkeypatch.setattr(D, "_probe", lambda d: "a test kernel failed (INVALID_KERNEL_NAME)" if d == dev else "")
    assert cli.main(["bench", "--device", idx, "--steps", "1"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert f"'{idx}'" in line and "cannot run clgpt's kernels" in line and "clgpt devices" in line
    monkeypatch.undo()
    broken = [i for i, d in D._all_devices() if not D.is_simulator(d) and D._probe(d)]
    for idx in broken:
        r = subprocess.run([sys.executable, "-m", "clgpt", "bench", "--device", idx, "--steps", "1"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 1 and f"'{idx}'" in one_line_error(r.stderr)


def test_ci_runs_the_kernels_on_two_implementations():
    """CI runs the kernel tests on two compilers: PyPI's PoCL and Intel's runtime, or, where PyPI's PoCL runs
    none of our kernels, the distribution's PoCL that .ci/run adds; elsewhere the tests run on whatever
    implementations work, one at least."""
    from clgpt.device.opencl import cpu_implementations

    found = cpu_implementations()
    assert len(found) >= (2 if os.environ.get("CI") == "true" else 1), found

"""Shared test setup: the repository as working folder; the OpenCL device a module's tests use (`dev`) and the
helpers that move arrays to and from it (`to_dev`, `empty`, `from_dev`) and compare them with a reference
(`assert_close`); and the suite's longest workflow runs started in the background at the session's start, so
the rest of the suite runs while they do.

The tiny pipeline + 2-point sweep (test_pipeline.SWEEP) runs once locally, feeding tests/test_sweep.py,
tests/test_mpi.py and tests/test_slurm.py, and once through the SLURM profile for tests/test_slurm.py (which
spends most of its minutes waiting on SLURM's status checks, the CPU idle). Each starts only when a selected
test needs its fixture (`local_sweep`, `slurm_sweep`), and is stopped when the session ends. Where no SLURM
answers, the session first starts the single-node one of .ci/slurm.sh (as root) and stops it at the end."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)  # tests read config.yaml, data/ and kernels/ relative to the repository
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def dev(opencl):
    """The OpenCL device of the implementation the `opencl` fixture sets for this module's run."""
    from clgpt.device.opencl import get_device

    return get_device()


def to_dev(dev, a):
    """A device buffer holding a copy of the array a."""
    a = np.ascontiguousarray(a)
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)


def empty(dev, n, dtype=np.float32):
    """A device buffer of n values of dtype (at least one), contents undefined."""
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, max(1, n) * np.dtype(dtype).itemsize)


def from_dev(dev, buf, shape, dtype=np.float32):
    """The buffer's first values as an array of shape and dtype, once the queue has written them."""
    out = np.empty(shape, dtype)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def assert_close(got, want, atol, rtol, what=""):
    """got within atol + rtol * |want| of want everywhere (in float64), of the same shape; NaN is never close."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    diff = np.abs(got - want)
    bad = ~(diff <= atol + rtol * np.abs(want))  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {want.size} values off, max abs diff {np.nanmax(diff):.3e} "
                           f"(atol {atol:g}, rtol {rtol:g})")


class Background:
    """`python -m snakemake ARGS` in the workflow copy `path`, started now in its own process group; its
    output (stdout and stderr) goes to PATH.out beside the folder."""

    def __init__(self, path: Path, *args: str):
        self.path, self.log, self.rc = path, path.with_name(path.name + ".out"), None
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=path, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 1800) -> str:
        """Its output, once it has ended with exit code 0 (the test fails otherwise)."""
        if self.rc is None:
            try:
                self.rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"snakemake in {self.path} still running after {timeout} s")
        out = self.log.read_text(errors="replace")
        assert self.rc == 0, out[-6000:]
        return out

    def stop(self) -> None:
        """Ends it if it still runs (SIGTERM: Snakemake cancels its SLURM jobs on the way out)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_plain_weights():
    """llama.cpp, the referee, loads weights as written: no repacking into its extra buffer types (the CPU's
    repacked and AMX layouts). On an Intel Xeon with AMX and AVX-512, llama-cpp-python 0.3.36 with them on
    crashed (segmentation fault) in test_llama_parity's q8_0 logits, on this tree and on earlier ones alike; its
    plain CPU kernels compute the same products."""
    try:
        from llama_cpp import llama_cpp as lib
    except ImportError:
        yield
        return
    default = lib.llama_model_default_params

    def plain():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain
    yield
    lib.llama_model_default_params = default


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
    """{name: Background} of the runs the selected tests need, started before the first test."""
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    runs, slurm_started = {}, False
    if wanted & {"local_sweep", "slurm_sweep"}:
        from test_pipeline import SWEEP, make_workdir

        base = tmp_path_factory.mktemp("sweep")
        runs["local"] = Background(make_workdir(base / "local", SWEEP), "--cores", "2", "model.gguf", "sweep")
        if "slurm_sweep" in wanted:
            from test_slurm import start_slurm

            slurm_started, missing = start_slurm()  # the README's `pytest` alone sets SLURM up, as root
            if missing:  # the test fails (never skips) and says what is missing
                runs["slurm"] = missing
            else:
                cluster = make_workdir(base / "cluster", SWEEP)
                shutil.copytree(ROOT / "profiles", cluster / "profiles")
                runs["slurm"] = Background(cluster, "--profile", "profiles/slurm",
                                           "--slurm-init-seconds-before-status-checks", "2", "model.gguf", "sweep")
    yield runs
    for run in runs.values():
        if isinstance(run, Background):
            run.stop()
    if slurm_started:  # only the SLURM this session started; one already running is left as it was
        from test_slurm import stop_slurm

        stop_slurm()


@pytest.fixture(scope="session")
def local_sweep(_background_runs) -> Path:
    """The workflow folder where `snakemake --cores 2 model.gguf sweep` ran test_pipeline.SWEEP."""
    run = _background_runs["local"]
    run.wait()
    return run.path


@pytest.fixture(scope="session")
def slurm_sweep(_background_runs) -> tuple[Path, str]:
    """(folder, output) of the same run through `--profile profiles/slurm`."""
    run = _background_runs["slurm"]
    if isinstance(run, str):
        pytest.fail(f"this test needs a running SLURM: {run}")
    return run.path, run.wait()


# The kernel, engine, dropout and llama.cpp-parity tests run once on each working CPU OpenCL implementation
# (PoCL, Intel's runtime): a kernel that only one compiler accepts, or that gives other numbers, fails here.
# test_flash and test_precision_* check the NVIDIA-only kernels (tensor-core instructions emulated) on one CPU
# runtime: they run on no CPU in use, and emulating them costs minutes per compiler.
KERNEL_MODULES = {"test_kernels_gemm", "test_kernels_copies", "test_kernels_attention", "test_kernels_norms",
                  "test_kernels_pointwise", "test_kernels_xent", "test_kernels_optim", "test_kernels_reference",
                  "test_kernels_flash_portable"}
ON_EVERY_IMPLEMENTATION = KERNEL_MODULES | {"test_engine", "test_engine_contract", "test_llama_engine",
                                            "test_llama_rows", "test_dropout", "test_llama_parity", "test_kvcache",
                                            "test_muon"}


# The emulated NVIDIA kernels (tensor-core instructions done with local memory and barriers) run on no CPU or
# GPU in use and take minutes to emulate per compiler: those modules run on PoCL where one works, else on the
# first implementation (Intel's builds the emulated flash kernels unoptimised, see clgpt/device/opencl.py).
ON_POCL = {"test_flash", "test_precision_gemm", "test_precision_mma", "test_precision_bf16", "test_precision_wgmma",
           "test_precision_selection", "test_precision_engine", "test_tuner"}


# Mesa's rusticl, where installed (Debian: mesa-opencl-icd), is the third compiler: clang, SPIR-V and NIR, as for
# AMD's and Intel's GPUs on Linux. Its CPU device (llvmpipe: no fp16, fp64 or subgroups, 32 KB of local memory) is
# listed only when RUSTICL_ENABLE asks for it. Mesa 22.3's rusticl compiles each kernel with LLVM on its first launch
# on a machine and runs them up to 150 times slower than PoCL, so it takes only the kernel, engine and llama.cpp-parity
# modules (names starting with ON_RUSTICL), and there leaves out: products of over RUSTICL_MAX_MACS multiply-adds
# (a minute each); the CPU row's register-blocked matmul forms (rb*: no GPU runs them, and LLVM takes minutes over
# their 96 to 480 accumulators a work-item); the parity tests that train a model of their own (the others share one).
os.environ.setdefault("RUSTICL_ENABLE", "llvmpipe")
ON_RUSTICL = ("test_kernels", "test_engine", "test_llama_parity")
RUSTICL_MAX_MACS = 50_000_000
RUSTICL_LEAVES_OUT = ("test_matmul_rb", "test_bf16_trained_model", "test_bias_off_model")


def _left_out_on_rusticl(item) -> bool:
    call = getattr(item, "callspec", None)
    if call is None or "rusticl" not in call.id.split("-"):
        return False
    p = call.params
    macs = p.get("M", 1) * p.get("N", 1) * p.get("K", 1)
    return (not item.module.__name__.startswith(ON_RUSTICL) or item.name.startswith(RUSTICL_LEAVES_OUT)
            or str(p.get("form", "")).startswith("rb") or macs > RUSTICL_MAX_MACS)


def pytest_collection_modifyitems(config, items):
    """Deselect the rusticl cases the note above leaves out."""
    dropped = [item for item in items if _left_out_on_rusticl(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _left_out_on_rusticl(item)]


def pytest_generate_tests(metafunc):
    name = metafunc.module.__name__
    if name in ON_EVERY_IMPLEMENTATION | ON_POCL and "opencl" in metafunc.fixturenames:
        from clgpt.device.opencl import cpu_implementations

        impls = cpu_implementations(gpu_first=True)
        if name in ON_POCL:
            first = next((k for k in impls if k in ("pocl", "auto")), next(iter(impls)))
            impls = {first: impls[first]}
        metafunc.parametrize("opencl", list(impls.values()), ids=list(impls), indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def opencl(request):
    """The OpenCL device a module's tests use, as PYOPENCL_CTX (which get_device and subprocesses read)."""
    spec = getattr(request, "param", None)
    if not spec:
        yield None
        return
    old = os.environ.get("PYOPENCL_CTX")
    os.environ["PYOPENCL_CTX"] = spec
    yield spec
    if old is None:
        os.environ.pop("PYOPENCL_CTX", None)
    else:
        os.environ["PYOPENCL_CTX"] = old

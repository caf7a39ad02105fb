"""OpenCL device choice and the program loader.

Choice is never interactive: an explicit spec ("p:d" like PYOPENCL_CTX, or a device-name substring),
else PYOPENCL_CTX, else the first GPU on any platform, else the first CPU device (PoCL) whose compiler works.
A simulator (Oclgrind) or a software rasteriser (Mesa's llvmpipe) is never chosen automatically; named, it runs
after a one-line warning of how slow it is.
Programs are built once per (device, kernel file, build options); kernels are fetched once.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pyopencl as cl

from clgpt.device import knobs, sm90a
from clgpt.errors import ClgptError
from clgpt.device.icd import register_pip_runtimes, separate_pocl_cache
from clgpt.paths import data_path
from clgpt.ranks import env_rank

KERNEL_DIR = data_path("kernels")  # beside the package in a checkout, inside it in a wheel

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def kernel_source(path: Path, _seen: tuple = ()) -> str:
    """The text of a kernel file with each `#include "x.cl"` replaced by kernels/x.cl's text (recursively),
    `#line` directives keeping compiler messages' files and line numbers. Inlined here rather than built
    with `-I KERNEL_DIR`: the build options then name no folder, so the compile caches (PoCL's, a driver's)
    hit across checkouts and workflow copies; with -I every new folder compiled every program afresh."""
    text = path.read_text()
    out, last, line = [], 0, 1
    for m in _INCLUDE.finditer(text):
        line += text.count("\n", last, m.start())
        included = KERNEL_DIR / m.group(1)
        if not included.is_file() or m.group(1) in _seen:
            raise ClgptError(f"{path}:{line}: #include \"{m.group(1)}\": no such kernel file in {KERNEL_DIR}"
                             if not included.is_file() else f"{path}: #include cycle through {m.group(1)}")
        out += [text[last:m.start()], f'#line 1 "{m.group(1)}"\n',
                kernel_source(included, (*_seen, path.name)).rstrip("\n"), f'\n#line {line + 1} "{path.name}"']
        last = m.end()
    return "".join(out) + text[last:]


_NO_PLATFORM = ("no OpenCL platform found; reinstall clgpt (pip install -e .), which brings PoCL and, on x86-64, "
                "Intel's CPU runtime")

register_pip_runtimes()  # before pyopencl first lists platforms: the loader reads its vendors once a process
separate_pocl_cache(rank=env_rank())  # likewise: PoCL reads its cache folder once


def _all_devices() -> list[tuple[str, cl.Device]]:
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # e.g. PLATFORM_NOT_FOUND_KHR from the ICD loader
        platforms = []
    out = []
    for pi, plat in enumerate(platforms):
        try:
            devs = plat.get_devices()
        except cl.Error:
            devs = []
        for di, dev in enumerate(devs):
            out.append((f"{pi}:{di}", dev))
    if not out:
        raise ClgptError(_NO_PLATFORM)
    return out


def _build(prg: cl.Program, options: list) -> cl.Program:
    """prg built; compilers' logs of a build that succeeded (Intel's prints one for every program) stay quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        return prg.build(options=options)


def _kind(dev) -> str:
    if is_simulator(dev):
        return "SIM"
    return "GPU" if dev.type & cl.device_type.GPU else "CPU" if dev.type & cl.device_type.CPU else "ACC"


def is_simulator(dev) -> bool:
    """Oclgrind reports itself as every device type, a GPU included, and runs kernels thousands of times slower:
    it is taken only when asked for by name or index."""
    return "oclgrind" in f"{dev.platform.name} {dev.name}".lower()


def is_software_rasteriser(dev) -> bool:
    """Mesa's llvmpipe (behind rusticl or clover) draws on the CPU and ran clgpt's training at about 1/150 of
    PoCL's speed on the same cores: taken only when asked for by name or index, as the simulator."""
    return "llvmpipe" in f"{dev.name} {dev.platform.name}".lower()


def is_slow(dev) -> bool:
    """A device the automatic choice never takes: the simulator or a software rasteriser."""
    return is_simulator(dev) or is_software_rasteriser(dev)


def slow_warning(dev, spec: str) -> str:
    """The one line said before work starts on a device that is_slow; "" for any other."""
    if is_simulator(dev):
        what = ("Oclgrind, a simulator that checks every memory access: it runs kernels thousands of times slower "
                "than a real device (a training step of the default model takes minutes)")
    elif is_software_rasteriser(dev):
        what = ("Mesa's llvmpipe, a software rasteriser: it runs clgpt's kernels about 150 times slower than PoCL "
                "on the same CPU")
    else:
        return ""
    return (f"warning: OpenCL device {spec!r} is {what}; for real work name another device (`clgpt devices` lists "
            "them; e.g. device: \"pocl\")")


_warned: set[int] = set()


def _warn_if_slow(devs: list, spec: str) -> None:
    """Says slow_warning once per device and process (only rank 0 of a data-parallel stage)."""
    import sys

    for d in devs:
        line = slow_warning(d, spec)
        if line and d.int_ptr not in _warned and env_rank() == 0:
            _warned.add(d.int_ptr)
            print(line, file=sys.stderr, flush=True)


def _is_pocl(dev) -> bool:
    return "portable computing language" in dev.platform.name.lower() or "pocl" in dev.platform.version.lower()


_probe_cache: dict[int, str] = {}


def _probe(dev) -> str:
    """"" where the device builds, creates and runs a real kernel of ours and gets the right numbers, else why
    not. A one-line build is not enough: PyPI's PoCL (LLVM 14) builds that on CPUs its LLVM does not know, then
    fails on our programs (clBuildProgram fails on AMD Zen 5, clCreateKernel gives INVALID_KERNEL_NAME on Zen 4).
    The kernel is the grad-norm work-group sum of kernels/adamw.cl: an #include, local memory and barriers."""
    key = dev.int_ptr
    if key not in _probe_cache:
        import numpy as np

        try:
            ctx = cl.Context([dev])
            queue = cl.CommandQueue(ctx)
            prg = _build(cl.Program(ctx, kernel_source(KERNEL_DIR / "adamw.cl")), ["-DLW=16"])
            k = cl.Kernel(prg, "grad_norm_partial_wg")
            g = (np.arange(1000, dtype=np.float32) % 7 - 3) / 4
            mf = cl.mem_flags
            g_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=g)
            parts = np.zeros(4, np.float32)
            p_buf = cl.Buffer(ctx, mf.WRITE_ONLY, parts.nbytes)
            k(queue, (64,), (16,), np.int32(g.size), g_buf, p_buf)
            cl.enqueue_copy(queue, parts, p_buf, is_blocking=True)
            want = (g.astype(np.float64) ** 2).sum()
            ok = abs(float(parts.astype(np.float64).sum()) - want) <= 1e-4 * want
            _probe_cache[key] = "" if ok else "a test kernel gave wrong results"
        except Exception as e:  # noqa: BLE001 - any failure of the driver means "cannot run our kernels"
            first = str(e).strip().splitlines()[0].split(" - ")[0] if str(e).strip() else type(e).__name__
            _probe_cache[key] = f"a test kernel failed ({first[:120]})"
    return _probe_cache[key]


def _describe(dev) -> str:
    return f"{dev.name.strip()!r} ({dev.platform.name.strip()}, {dev.platform.version.strip()})"


def _cannot(dev, spec: str | None = None) -> ClgptError:
    asked = f"OpenCL device {spec!r}, " if spec else "OpenCL device "
    return ClgptError(f"{asked}{_describe(dev)}, cannot run clgpt's kernels: {_probe(dev)}; pick another device "
                      "(`clgpt devices` lists them) with --device, `device:` in config.yaml or PYOPENCL_CTX")


def _real_cpus(devs, rasteriser: bool = False) -> list[tuple[str, cl.Device]]:
    """The (index, device) rows of the CPU devices that are no simulator, PoCL's first, else in listing order;
    a software rasteriser (llvmpipe) only with `rasteriser` (the implementations the tests run on)."""
    cpus = [(idx, d) for idx, d in devs if d.type & cl.device_type.CPU and not is_simulator(d)
            and (rasteriser or not is_software_rasteriser(d))]
    return sorted(cpus, key=lambda row: not _is_pocl(row[1]))


def _working_gpus(devs) -> list[cl.Device]:
    return [d for _, d in devs if d.type & cl.device_type.GPU and not is_slow(d) and not _probe(d)]


def _auto(devs) -> list[cl.Device]:
    """The automatic choice in order: every working GPU, else the first working CPU device, PoCL's ahead of
    other implementations (so results stay PoCL's wherever it works), never a simulator."""
    gpus = _working_gpus(devs)
    if gpus:
        return gpus
    cpus = [d for _, d in _real_cpus(devs)]
    for d in cpus:
        if not _probe(d):
            return [d]
    tried = cpus or [d for _, d in devs if not is_slow(d)]
    if tried:
        raise ClgptError(f"no OpenCL device here can run clgpt's kernels (tried {', '.join(map(_describe, tried))}: "
                         f"{_probe(tried[0])}); reinstall clgpt (pip install -e .) to get Intel's CPU runtime on "
                         "x86-64, or install a newer PoCL (Debian/Ubuntu: apt install pocl-opencl-icd)")
    raise ClgptError(_NO_PLATFORM)


def cpu_implementations(gpu_first: bool = False) -> dict[str, str]:
    """{"pocl" / "intel" / platform name: "p:d"} of the first working device of each CPU OpenCL implementation,
    PoCL first: what the tests run every kernel on, and what bench/bench_opencl.py compares. gpu_first: where a
    GPU is the automatic choice, {"auto": ""} instead."""
    devs = _all_devices()
    if gpu_first and _working_gpus(devs):
        return {"auto": ""}
    found = {}
    for idx, d in _real_cpus(devs, rasteriser=True):  # rusticl's llvmpipe too: a compiler of its own
        if not _probe(d):
            name = "pocl" if _is_pocl(d) else "intel" if "intel" in d.platform.name.lower() else d.platform.name
            found.setdefault(name, idx)
    return found


def _listing(devs) -> str:
    return "; ".join(f"{idx} {d.name.strip()}" for idx, d in devs)


def _explicit(spec: str, devs) -> list[cl.Device]:
    """The devices an explicit spec names ("p:d", "p", or a part of a name), each checked by the probe."""
    parts = spec.split(":")
    if len(parts) == 1 and parts[0].strip().isdigit():  # "P" (PYOPENCL_CTX=0, say): the devices of platform P
        found = [d for idx, d in devs if idx.split(":")[0] == parts[0].strip()]
    elif all(p.strip().isdigit() for p in parts) and len(parts) == 2:
        found = [d for idx, d in devs if idx == f"{int(parts[0])}:{int(parts[1]) if parts[1].strip() else 0}"]
    else:  # a part of a device's or platform's name ("EPYC", "Intel", "PoCL")
        found = [d for _, d in devs if spec.lower() in f"{d.name} {d.platform.name} {d.platform.version}".lower()]
        found = [d for d in found if not is_slow(d)] or found  # a slow one only where nothing else matches
    if not found:
        raise _not_found(spec, devs)
    working = [d for d in found if not _probe(d)]
    if not working:
        raise _cannot(found[0], spec)
    _warn_if_slow(working, spec)
    return working


def _not_found(spec: str, devs) -> ClgptError:
    """The error for a device spec that matches nothing; it names PYOPENCL_CTX when the spec came from it."""
    if os.environ.get("PYOPENCL_CTX", "").strip() == spec:
        return ClgptError(f"PYOPENCL_CTX={spec!r} names no OpenCL device; available devices: {_listing(devs)}; "
                          "unset PYOPENCL_CTX or set it to one of them")
    return ClgptError(f"OpenCL device {spec!r} not found; available devices: {_listing(devs)}")


def _pick(spec: str | None) -> cl.Device:
    return matching_devices(spec)[0]


def matching_devices(spec: str | None) -> list[cl.Device]:
    """Every device `spec` could mean, in listing order: "" (and no PYOPENCL_CTX) -> every working GPU, else the
    one CPU device the automatic choice takes (ranks on one CPU share it: two implementations would give two
    ranks different sums); "p:d" -> that one; "p" -> every device of platform p; a name part -> every device
    whose name holds it. Ranks of a data-parallel stage take these by their local index (clgpt.training.dist)."""
    devs = _all_devices()
    spec = (spec or "").strip() or os.environ.get("PYOPENCL_CTX", "").strip()
    return _explicit(spec, devs) if spec else _auto(devs)


def get_device_for(dev: cl.Device) -> "Device":
    """The cached Device of one OpenCL device (as get_device returns it)."""
    key = f"{dev.platform.name}|{dev.name}|{dev.int_ptr}"
    if key not in _cache:
        _cache[key] = Device(dev)
    return _cache[key]


def list_devices() -> list[tuple[str, str, str, bool, str]]:
    """-> [(index "p:d", name, type, chosen, note)]: chosen marks what get_device() would pick; note says why a
    device is never chosen automatically ("" for one that could be)."""
    devs = _all_devices()
    try:
        chosen = _pick(None)
    except ClgptError:
        chosen = None
    out = []
    for idx, d in devs:
        note = ("simulator: used only when named" if is_simulator(d)
                else "software rasteriser, about 150x slower than PoCL: used only when named" if is_software_rasteriser(d)
                else f"cannot run clgpt's kernels: {_probe(d)}" if _probe(d) else "")
        out.append((idx, f"{d.name.strip()} [{d.platform.name.strip()}]", _kind(d),
                    d == chosen, note))
    return out


def _define(key: str, value) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float):
        return f"-D{key}={value!r}f"
    return f"-D{key}={value}"


class Device:
    """One OpenCL device with its context, in-order queue and program/kernel caches."""

    def __init__(self, device: cl.Device):
        self.device = device
        self.name = device.name.strip()
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        self._programs: dict[tuple, cl.Program] = {}
        self._kernels: dict[tuple, cl.Kernel] = {}

    def program(self, file_stem: str, build_options: tuple = (), **defines) -> cl.Program:
        """build_options: compiler flags beyond the -D defines (e.g. NVIDIA's -cl-nv-verbose). MAXNREG among the
        defines caps the registers of the program's kernels on NVIDIA devices (sm90a.cap_registers)."""
        if file_stem == "flash" and defines.get("MMA_EMULATE") and not _is_pocl(self.device):
            # the emulated tensor-core flash kernels (tests only) come out of Intel's CPU compiler with a wrong dq
            # (relative error 0.99; right with optimisation off), whatever the cause: tests get the right numbers
            build_options = (*build_options, "-cl-opt-disable")
        options = tuple(_define(k, v) for k, v in sorted(defines.items())) + tuple(build_options)
        key = (file_stem, options)
        prg = self._programs.get(key)
        if prg is None:
            path = KERNEL_DIR / f"{file_stem}.cl"
            if not path.exists():
                raise ClgptError(f"kernel file {path} not found")
            try:
                # kernels share pieces through #include "reduce.cl": kernel_source inlines them
                source = kernel_source(path)
                try:
                    prg = _build(cl.Program(self.ctx, source), list(options))
                except cl.RuntimeError:
                    if not _is_pocl(self.device):
                        raise
                    # PoCL fails a build that races another process's on its shared kernel cache (pocl/pocl#1480):
                    # two single-rank jobs of a sweep can; the second try finds the cache settled
                    prg = _build(cl.Program(self.ctx, source), list(options))
                if sm90a.MARK in source and not defines.get("WGMMA_EMULATE"):
                    # wgmma and the like, written as PTX comments (clgpt/device/sm90a.py)
                    if knobs.read().sm90a_verbose:  # which build ptxas's lines below are about
                        print(f"{file_stem}: {' '.join(options)}", flush=True)
                    prg = sm90a.retarget(self.ctx, self.device, prg, defines.get("SMEM_BYTES"))
                if defines.get("MAXNREG") and "nvidia" in self.device.platform.name.lower():
                    prg = sm90a.cap_registers(self.ctx, self.device, prg, defines["MAXNREG"])
            except cl.RuntimeError as e:
                raise ClgptError(f"building {path} with {' '.join(options)} failed on {self.name}:\n{e}") from e
            self._programs[key] = prg
        return prg

    def kernel(self, file_stem: str, name: str, build_options: tuple = (), **defines) -> cl.Kernel:
        """The kernel `name` of kernels/<file_stem>.cl built with -D defines; built and fetched once."""
        key = (file_stem, name, tuple(sorted(defines.items())), tuple(build_options))
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = cl.Kernel(self.program(file_stem, tuple(build_options), **defines), name)
        return k

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


_cache: dict[str, Device] = {}


def resolve_device(device: "Device | str | None" = None) -> Device:
    """A Device as given, or the one a spec string (or None: PYOPENCL_CTX, a GPU, PoCL) names."""
    if device is None or isinstance(device, str):
        return get_device(device or None)
    return device


def get_device(spec: str | None = None) -> Device:
    """The chosen device (see module doc); one Device (context, queue, caches) per OpenCL device."""
    return get_device_for(_pick(spec))


def decode_device(spec: str | None = None) -> Device:
    """The device `clgpt generate` and `clgpt chat` decode on: get_device's, except where that is a CPU and
    Intel's CPU runtime works here, which then decodes. A decode step is a dozen small launches and one read of
    the logits, so how soon the runtime returns from them is the step's time: on a 2-core Zen 4 machine one launch
    and a read took Intel's runtime 8 us and PoCL's 60-90 us (its idle workers sleep), and the default model
    decoded 3,503 tokens/s against 1,878 (bench/bench_generate.py). Training stays on PoCL, faster there. A spec,
    or PYOPENCL_CTX, is taken as given."""
    spec = (spec or "").strip() or os.environ.get("PYOPENCL_CTX", "").strip()
    intel = None if spec else cpu_implementations(gpu_first=True).get("intel")
    return get_device(spec or intel)

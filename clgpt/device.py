"""OpenCL device choice and the program loader.

Choice is never interactive: an explicit spec ("p:d" like PYOPENCL_CTX, or a device-name substring),
else PYOPENCL_CTX, else the first GPU on any platform, else the first CPU device (PoCL) whose compiler works.
Programs are built once per (device, kernel file, build options); kernels are fetched once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyopencl as cl

from clgpt import sm90a
from clgpt.errors import ClgptError
from clgpt.paths import data_path

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


_NO_PLATFORM = "no OpenCL platform found; install PoCL: pip install pocl-binary-distribution"


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


_builds_cache: dict[int, bool] = {}


def _builds(dev: cl.Device) -> bool:
    """Whether the device's compiler builds a one-line kernel. PoCL from PyPI (pocl-binary-distribution 3.0,
    LLVM 14) fails on every program on CPUs its LLVM does not know ("unknown target CPU 'generic'": AMD Zen 5,
    say), where a newer PoCL beside it (Debian's pocl-opencl-icd) works; the automatic choice skips such a device."""
    key = dev.int_ptr
    if key not in _builds_cache:
        try:
            cl.Program(cl.Context([dev]), "__kernel void probe(__global float* x) { x[0] = 1.0f; }").build()
            _builds_cache[key] = True
        except cl.Error:
            _builds_cache[key] = False
    return _builds_cache[key]


def _cpus(devs) -> list[cl.Device]:
    """The CPU devices whose compiler works, in listing order; a one-line error where there are CPUs but none
    builds a kernel."""
    cpus = [d for _, d in devs if d.type & cl.device_type.CPU]
    ok = [d for d in cpus if _builds(d)]
    if cpus and not ok:
        raise ClgptError(f"OpenCL CPU device {cpus[0].name.strip()!r} ({cpus[0].platform.version.strip()}) "
                         "cannot build kernels (its LLVM does not know this CPU); install a newer PoCL "
                         "(Debian/Ubuntu: apt install pocl-opencl-icd) or pick another device with PYOPENCL_CTX")
    return ok


def _listing(devs) -> str:
    return "; ".join(f"{idx} {d.name.strip()}" for idx, d in devs)


def _pick(spec: str | None) -> cl.Device:
    devs = _all_devices()
    spec = (spec or "").strip() or os.environ.get("PYOPENCL_CTX", "").strip()
    if not spec:
        for _, d in devs:
            if d.type & cl.device_type.GPU:
                return d
        cpus = _cpus(devs)
        return cpus[0] if cpus else devs[0][1]
    parts = spec.split(":")
    if all(p.strip().isdigit() for p in parts) and len(parts) <= 2:
        pi = int(parts[0])
        di = int(parts[1]) if len(parts) == 2 and parts[1].strip() else 0
        for idx, d in devs:
            if idx == f"{pi}:{di}":
                return d
    else:
        for _, d in devs:
            if spec.lower() in d.name.lower():
                return d
    raise _not_found(spec, devs)


def _not_found(spec: str, devs) -> ClgptError:
    """The error for a device spec that matches nothing; it names PYOPENCL_CTX when the spec came from it."""
    if os.environ.get("PYOPENCL_CTX", "").strip() == spec:
        return ClgptError(f"PYOPENCL_CTX={spec!r} names no OpenCL device; available devices: {_listing(devs)}; "
                          "unset PYOPENCL_CTX or set it to one of them")
    return ClgptError(f"OpenCL device {spec!r} not found; available devices: {_listing(devs)}")


def matching_devices(spec: str | None) -> list[cl.Device]:
    """Every device `spec` could mean, in listing order: "" (and no PYOPENCL_CTX) -> all GPUs, else all
    CPUs; "p:d" -> that one; "p" -> every device of platform p; a name part -> every device whose name
    holds it. Ranks of a data-parallel stage take these by their local index (clgpt.dist)."""
    spec = (spec or "").strip() or os.environ.get("PYOPENCL_CTX", "").strip()
    devs = _all_devices()
    if not spec:
        gpus = [d for _, d in devs if d.type & cl.device_type.GPU]
        return gpus or _cpus(devs) or [devs[0][1]]
    parts = spec.split(":")
    if len(parts) == 1 and parts[0].isdigit():  # "P" (PYOPENCL_CTX=0, say): every device of platform P
        found = [d for idx, d in devs if idx.split(":")[0] == parts[0]]
        if found:
            return found
    if all(p.strip().isdigit() for p in parts) and len(parts) <= 2:
        return [_pick(spec)]
    found = [d for _, d in devs if spec.lower() in d.name.lower()]
    if not found:
        raise _not_found(spec, devs)
    return found


def get_device_for(dev: cl.Device) -> "Device":
    """The cached Device of one OpenCL device (as get_device returns it)."""
    key = f"{dev.platform.name}|{dev.name}|{dev.int_ptr}"
    if key not in _cache:
        _cache[key] = Device(dev)
    return _cache[key]


def list_devices() -> list[tuple[str, str, str, bool]]:
    """-> [(index "p:d", name, type, chosen)] where chosen marks what get_device() would pick."""
    devs = _all_devices()
    try:
        chosen = _pick(None)
    except ClgptError:
        chosen = None
    return [(idx, d.name.strip(), cl.device_type.to_string(d.type), d == chosen) for idx, d in devs]


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
        """build_options: compiler flags beyond the -D defines (e.g. NVIDIA's -cl-nv-maxrregcount=128)."""
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
                prg = cl.Program(self.ctx, source).build(options=list(options))
                if sm90a.MARK in source:  # wgmma and the like, written as PTX comments (clgpt/sm90a.py)
                    prg = sm90a.retarget(self.ctx, self.device, prg, defines.get("SMEM_BYTES"))
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

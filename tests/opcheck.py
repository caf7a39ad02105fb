"""check_op: the one helper the kernel tests check kernels with.

A kernel is launched once on numpy inputs (each test seeds its own), every output is compared with a float64
numpy reference, and, for a backward kernel, its gradients also with central finite differences of a float64
forward (so the backward kernel is checked against something it was not derived from):

    out = check_op(dev, "rmsnorm", "rmsnorm_backward", (N,), [("N", i32(N)), ("dout", dout), ("dx", dx0), ...],
                   want={"dx": dx0 + dx_ref}, defines=dict(C=C, EPS=1e-5),
                   fd=FD(lambda x, w: ref.rmsnorm_forward(x, w)[0], {"x": x, "w": w}, dout,
                         grads={"dx": "x"}, base={"dx": dx0}))

args: (key, value) in the kernel's argument order; a numpy array becomes a device buffer (copied in, read back
after the launch under its key), a string names an earlier array argument whose buffer is passed again (in-place
kernels), anything else (np.int32, np.float32, None) is passed as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl

from clgpt.device.knobs import Knobs
from clgpt.models import reference as ref

from conftest import assert_close


@dataclass
class FD:
    """Finite differences of L = sum(forward(**inputs) * dout) (all float64): the kernel output `key` of
    grads {key: input name} must be dL/d(input) (after subtracting base[key], for kernels that accumulate).
    n entries of each input, evenly spread, are probed; eps is the central-difference step."""

    forward: callable
    inputs: dict
    dout: np.ndarray
    grads: dict
    base: dict = field(default_factory=dict)
    n: int = 40
    eps: float = 1e-6


def run_op(dev, file, name, gsize, args, defines=None, lsize=None) -> dict:
    """Launch kernels/<file>.cl `name` once -> {key: array read back} for every array argument."""
    kern = dev.kernel(file, name, **(defines or {}))
    mf, bufs, call = cl.mem_flags, {}, []
    for key, a in args:
        if isinstance(a, str):  # the buffer of an earlier argument: in-place kernels
            call.append(bufs[a][0])
        elif isinstance(a, np.ndarray):
            a = np.ascontiguousarray(a)
            bufs[key] = (cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a), a)
            call.append(bufs[key][0])
        else:
            call.append(a)
    kern(dev.queue, tuple(gsize), None if lsize is None else tuple(lsize), *call)
    out = {}
    for key, (buf, a) in bufs.items():
        out[key] = np.empty_like(a)
        cl.enqueue_copy(dev.queue, out[key], buf, is_blocking=True)
    return out


def fd_grad(forward, inputs: dict, dout, name, n, eps) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, dL/d inputs[name] there) by central differences, L = sum(forward(**inputs) * dout)."""
    x = {k: np.array(v, np.float64) for k, v in inputs.items()}
    d = np.asarray(dout, np.float64)
    size = x[name].size
    idx = np.unique(np.linspace(0, size - 1, min(n, size)).astype(int))
    out = np.empty(len(idx))
    for j, i in enumerate(idx):
        old = x[name].flat[i]
        x[name].flat[i] = old + eps
        fp = (np.asarray(forward(**x), np.float64) * d).sum()
        x[name].flat[i] = old - eps
        fm = (np.asarray(forward(**x), np.float64) * d).sum()
        x[name].flat[i] = old
        out[j] = (fp - fm) / (2 * eps)
    return idx, out


def assert_directional_fd(f, x, grad, rel, rng, n=3, eps=1e-4):
    """grad (d f / d x, from a kernel) along n random directions v equals central differences of the float64 f:
    |grad . v - (f(x + eps v) - f(x - eps v)) / 2 eps| < rel |that difference|."""
    for _ in range(n):
        v = rng.normal(size=x.shape)
        fd = (f(x + eps * v) - f(x - eps * v)) / (2 * eps)
        got = float((grad.astype(np.float64) * v).sum())
        assert abs(got - fd) < rel * abs(fd), f"directional derivative {got} vs finite differences {fd}"


def check_op(dev, file, name, gsize, args, want, defines=None, lsize=None, atol=1e-5, rtol=1e-5,
             fd: FD | None = None, scaled=True) -> dict:
    """Launch the kernel, compare each output `want` names with its float64 reference (tolerances relative to
    the reference's largest magnitude when `scaled`), and the gradients `fd` names with finite differences.
    -> the outputs read back."""
    out = run_op(dev, file, name, gsize, args, defines, lsize)
    for key, ref in want.items():
        s = max(1.0, float(np.abs(ref).max())) if scaled and np.size(ref) else 1.0
        assert_close(out[key].reshape(np.shape(ref)), ref, atol * s, rtol, f"{name} {key}")
    if fd is not None:
        for key, inp in fd.grads.items():
            got = out[key].astype(np.float64) - fd.base.get(key, 0.0)
            idx, num = fd_grad(fd.forward, fd.inputs, fd.dout, inp, fd.n, fd.eps)
            s = max(1.0, float(np.abs(num).max()))
            assert_close(got.reshape(-1)[idx], num, 1e-4 * s, 1e-4, f"{name} {key} against finite differences")
    return out


def tiled_index(Rp, Cp):
    """Where precision.cl's tiled_chunk puts element (r, c) of an Rp x Cp bf16 copy (the wgmma layout)."""
    r, c, e = np.arange(Rp)[:, None], np.arange(Cp)[None, :] // 8, np.arange(Cp)[None, :] % 8
    return ((((c // 8) * (Rp // 8) + r // 8) * 8 + r % 8) * 8 + ((c % 8) ^ (r % 8))) * 8 + e


def bf16_pattern(x):
    """x rounded to bf16 (round to nearest even), as the 16-bit patterns a bf16 copy holds."""
    return (ref.round_bf16(np.asarray(x, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


def _gpu_engine(launch="nvidia", **shape):
    """An Engine whose launch table row is a GPU's (split-K, batched attention, row kernels), on any device."""
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.gpt2 import GPT2Engine as Engine

    cfg = ModelConfig(vocab_size=16, n_ctx=shape.get("T", 8), n_embd=shape.get("C", 16), n_head=shape.get("H", 2),
                      n_layer=1, n_ff=32)
    return Engine(cfg, init_params(cfg, 0), batch_size=shape.get("B", 1), seq_len=shape.get("T", 8),
                  knobs=Knobs(launch=launch))

"""Portable flash attention's tiles (kernels/flash_portable.cl) and their tuner: a few candidates per kernel,
checked against float64 numpy and timed on the user's device at the model's (B, H, T, D), cached beside the GEMM's.

A kernel's tiles are (BR, BC, NC): BR rows a work-group (queries in the forward and dq, keys in dk/dv), BC rows of
the other side a step, NC work-items a row (BR * NC a work-group). They fit a device where the work-group and its
local memory do (local_bytes) and NC divides the head width and BC. CANDIDATES lists DEFAULT first (a start that
fits every profile of tests/test_tuner.py at a head width of 64), then shapes of 64 to 256 work-items; `tune` checks
each kernel's candidates on odd sizes (T not a multiple of any tile, dropout on) against clgpt.models.reference's
float64 attention, drops those that fail to build or agree, and keeps the fastest at the model's shape, ties to the
earlier. Tiles change the order of some sums (BC the steps', NC the forward's row sums): the record, like the
device, decides the bytes, and a pinned tuning file (clgpt.device.tuner) repeats a run exactly.

The record lives in the GEMM tuner's file (clgpt.device.tuner.save) under record_key: the shape and the kernel
source's hash, so an edited kernel is tuned again.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import numpy as np
import pyopencl as cl

from clgpt.device import tuner
from clgpt.device.builds import run_builds
from clgpt.device.knobs import Knobs
from clgpt.device.precision import matrix_path
from clgpt.device.opencl import KERNEL_DIR, Device, kernel_source
from clgpt.errors import ClgptError

KERNELS = ("flash_portable_forward", "flash_portable_backward_dq", "flash_portable_backward_dkv")
SHORT = dict(zip(KERNELS, ("forward", "dq", "dkv")))
NAME = {short: name for name, short in SHORT.items()}
DEFAULT = dict(forward=(64, 32, 4), dq=(64, 16, 4), dkv=(64, 16, 4))
# 256 work-items, then 128 (fewer registers a group: more groups a compute unit where the backward's two private
# rows of D floats take many)
_GRID = [(64, 32, 4), (64, 64, 4), (32, 32, 8), (128, 32, 2), (64, 16, 4), (32, 16, 8), (128, 16, 2),
         (32, 32, 4), (32, 16, 4), (64, 32, 2), (64, 16, 2)]
CANDIDATES = {k: [DEFAULT[k]] + [t for t in _GRID if t != DEFAULT[k]] for k in DEFAULT}
CHECK = (1, 75)  # the float64 check's B, T (the model's heads: the programs the run builds): no tile divides T
CHECK_TOL = 1e-4  # max |err| / max |ref| (fp32 sums: about 1e-6 when right)
# auto: the generic GPU row takes portable flash attention from this T (clgpt/ops/attention.py), where the batched
# form's T x T buffers reach 200 MB a layer at shape L; bench/flash_portable.py times the two forms
MIN_T = 512
# The form `attention: auto` takes on that row once tuned: the record's, the faster at the model's shape where the
# tuner timed both (on an H100 the batched form's products beat flash at T 512), flash where the batched form's
# saved scores would fill over SCORES_SHARE of the device's memory, or where there is nothing to time it with
FORMS = ("flash", "batched")
SCORES_SHARE = 0.25
BUDGET_S = 5.0  # a kernel's candidates past this are not timed (a slow device still gets a record)
TIMED_REPS = 3


def local_bytes(kernel: str, D: int, tiles: tuple[int, int, int]) -> int:
    """The local memory kernels/flash_portable.cl declares for `kernel` (short name) at head width D."""
    BR, BC, NC = tiles
    staged, scores = BC * (D + 4), BR * (BC + 1)
    return 4 * {"forward": staged + scores + 2 * BR * NC, "dq": 2 * staged + scores, "dkv": 2 * staged + 2 * scores + 2 * BC}[kernel]


def fits(kernel: str, D: int, tiles: tuple[int, int, int], max_group: int, local_mem: int) -> str:
    """"" where `tiles` can run `kernel` at head width D under the limits, else why not."""
    BR, BC, NC = tiles
    if D % NC or BC % NC:
        return f"{NC} work-items a row divide neither the head width {D} nor the step {BC}"
    if BR * NC > max_group:
        return f"{BR * NC} work-items exceed the device's work-group limit {max_group}"
    if local_bytes(kernel, D, tiles) > local_mem:
        return f"{local_bytes(kernel, D, tiles)} bytes of local memory exceed the device's {local_mem}"
    return ""


def candidates(kernel: str, D: int, max_group: int, local_mem: int) -> list[tuple[int, int, int]]:
    """CANDIDATES[kernel] that fit, in order; where none does, the smallest that respects NC | D."""
    out = [t for t in CANDIDATES[kernel] if not fits(kernel, D, t, max_group, local_mem)]
    if out:
        return out
    for t in ((32, 16, 1), (16, 16, 1), (16, 8, 1), (8, 8, 1)):
        if not fits(kernel, D, t, max_group, local_mem):
            return [t]
    raise ClgptError(f"flash attention at head width {D}: no tiles fit {local_mem} bytes of local memory; "
                     "set attention: batched")


def build(dev: Device, kernel: str, C: int, H: int, D: int, tiles, rnd: int = 0) -> cl.Kernel:
    """`kernel` (short name) built with `tiles`. The kernels declare reqd_work_group_size, so a compiler that
    builds one has fitted its registers to BR * NC items (CL_KERNEL_WORK_GROUP_SIZE is no guide: Mesa's rusticl
    reports 32 for kernels it runs at 256)."""
    return dev.kernel("flash_portable", NAME[kernel], **options(D, C, H, tiles, rnd))


def default_tiles(dev: Device, H: int, D: int) -> dict:
    """Each kernel's first candidate that fits the device and builds: the tiles an untuned run takes."""
    return {k: build_first(dev, k, H * D, H, D)[0] for k in DEFAULT}


def build_first(dev: Device, kernel: str, C: int, H: int, D: int, first=None,
                rnd: int = 0) -> tuple[tuple, cl.Kernel]:
    """(tiles, kernel): `first` (a record's tiles) if it builds and fits, else the first candidate that does."""
    lim = dev.device.max_work_group_size, dev.device.local_mem_size
    tried = [tuple(first)] if first else []
    for t in tried + [t for t in candidates(kernel, D, *lim) if t not in tried]:
        try:
            return t, build(dev, kernel, C, H, D, t, rnd)
        except (cl.Error, ClgptError):
            continue
    raise ClgptError(f"flash attention {kernel}: no tiles build on {dev.name}; set attention: batched")


def options(D: int, C: int, H: int, tiles: tuple[int, int, int], rnd: int = 0) -> dict:
    """The -D build options of a kernel with `tiles`; rnd: precision.cl's ROUND of the products' operands (0: fp32,
    left out, so the tuner's programs are the fp32 run's)."""
    opts = dict(C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)), BR=tiles[0], BC=tiles[1], NC=tiles[2])
    return dict(opts, ROUND=rnd) if rnd else opts


def grid(T: int, BH: int, tiles: tuple[int, int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(global, local) sizes of a launch over B*H heads of T rows."""
    BR, _, NC = tiles
    return (-(-T // BR) * BR * NC, BH), (BR * NC, 1)


def source_hash() -> str:
    return hashlib.sha256(kernel_source(KERNEL_DIR / "flash_portable.cl").encode()).hexdigest()[:12]


def record_key(B: int, H: int, T: int, D: int) -> str:
    """The record's name in a tuning file: the shape and the kernel source's hash."""
    return f"flash_portable:{source_hash()}:B{B}H{H}T{T}D{D}"


def check_record(record, where: str) -> dict:
    """`record` if it names tiles for each kernel, else a one-line ClgptError naming `where`."""
    try:
        ok = all(len(record["tiles"][k]) == 3 and all(int(v) > 0 for v in record["tiles"][k]) for k in DEFAULT)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ClgptError(f"{where}: its flash attention record names no tiles for {', '.join(DEFAULT)}; run "
                         "`clgpt tune-device` again or set tuning: auto")
    form = record.get("form", "flash")
    if form not in FORMS:
        raise ClgptError(f"{where}: its flash attention record's form {form!r} is neither {' nor '.join(FORMS)}; "
                         "run `clgpt tune-device` again or set tuning: auto")
    return {**{k: tuple(int(v) for v in record["tiles"][k]) for k in DEFAULT}, "form": form}


class Run:
    """Buffers of one (B, H, T, D) attention, and the three kernels' launches on them with given tiles."""

    def __init__(self, dev: Device, B: int, H: int, T: int, D: int, qkv=None, dout=None, rnd: int = 0):
        self.dev, self.B, self.H, self.T, self.D, self.rnd, C = dev, B, H, T, D, rnd, H * D
        r = np.random.default_rng(0)
        qkv = r.standard_normal((B, T, 3 * C), np.float32) if qkv is None else np.asarray(qkv, np.float32)
        dout = r.standard_normal((B, T, C), np.float32) if dout is None else np.asarray(dout, np.float32)
        mf = cl.mem_flags
        rw = lambda a: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))  # noqa: E731
        self.qkv, self.dout = rw(qkv), rw(dout)
        self.out, self.dqkv = (cl.Buffer(dev.ctx, mf.READ_WRITE, B * T * n * 4) for n in (C, 3 * C))
        self.lse, self.delta = (cl.Buffer(dev.ctx, mf.READ_WRITE, B * H * T * 4) for _ in range(2))

    def kernel(self, kernel: str, tiles) -> cl.Kernel:
        return build(self.dev, kernel, self.H * self.D, self.H, self.D, tiles, self.rnd)

    def launch(self, kernel: str, tiles, drop=(0, 0, 0.0)) -> None:
        seed, site, p = np.uint32(drop[0]), np.uint32(drop[1]), np.float32(drop[2])
        g, lsz = grid(self.T, self.B * self.H, tiles)
        args = {"forward": (self.qkv, self.out, self.lse),
                "dq": (self.qkv, self.dout, self.out, self.lse, self.delta, self.dqkv),
                "dkv": (self.qkv, self.dout, self.lse, self.delta, self.dqkv)}[kernel]
        self.kernel(kernel, tiles)(self.dev.queue, g, lsz, np.int32(self.T), *args, seed, site, p)

    def results(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """out (B,T,C), dqkv (B,T,3C), lse (B,H,T) as the kernels left them."""
        B, T, C = self.B, self.T, self.H * self.D
        got = np.empty((B, T, C), np.float32), np.empty((B, T, 3 * C), np.float32), np.empty((B, self.H, T), np.float32)
        for host, buf in zip(got, (self.out, self.dqkv, self.lse)):
            cl.enqueue_copy(self.dev.queue, host, buf)
        self.dev.queue.finish()
        return got

    def time(self, kernel: str, tiles) -> float:
        """Seconds a launch: after an untimed one, the least of TIMED_REPS."""
        self.launch(kernel, tiles)
        self.dev.queue.finish()
        best = float("inf")
        for _ in range(TIMED_REPS):
            t0 = time.perf_counter()
            self.launch(kernel, tiles)
            self.dev.queue.finish()
            best = min(best, time.perf_counter() - t0)
        return best


def reference(qkv, dout, H):
    """float64 causal attention -> out (B,T,C), dqkv (B,T,3C), as clgpt.models.reference computes them."""
    qkv, dout = np.asarray(qkv, np.float64), np.asarray(dout, np.float64)
    B, T, C3 = qkv.shape
    C = C3 // 3
    D = C // H
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    s = np.where(np.tril(np.ones((T, T), bool)), q @ k.transpose(0, 1, 3, 2) / math.sqrt(D), -np.inf)
    att = np.exp(s - s.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    dy = dout.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    dp = dy @ v.transpose(0, 1, 3, 2)
    ds = att * (dp - (att * dp).sum(-1, keepdims=True)) / math.sqrt(D)
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, C)  # noqa: E731
    grads = [merge(ds @ k), merge(ds.transpose(0, 1, 3, 2) @ q), merge(att.transpose(0, 1, 3, 2) @ dy)]
    return merge(att @ v), np.concatenate(grads, axis=-1)


def check(dev: Device, H: int, D: int, kernel: str, tiles, default: dict) -> str:
    """"" where `kernel` with `tiles` (the others with `default`) matches float64 at CHECK's odd sizes, else why
    not. (Dropout's mask index does not depend on the tiles: tests/test_kernels_flash_portable.py checks it.)"""
    B, T = CHECK
    r = np.random.default_rng(1)
    qkv, dout = r.standard_normal((B, T, 3 * H * D)), r.standard_normal((B, T, H * D))
    run = Run(dev, B, H, T, D, qkv, dout)
    try:
        for k in ("forward", "dq", "dkv"):
            run.launch(k, tiles if k == kernel else default[k])
        out, dqkv, _ = run.results()
    except (cl.Error, ClgptError) as e:
        return f"fails to build or launch ({str(e).splitlines()[0][:80]})"
    want = reference(qkv, dout, H)
    err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip((out, dqkv), want))
    return "" if err <= CHECK_TOL else f"disagrees with float64 numpy (max rel err {err:.2e})"


def _try_build(dev: Device, kernel: str, H: int, D: int, tiles) -> None:
    """Build one candidate's program, leaving a failure for its check to meet again and reject."""
    try:
        build(dev, kernel, H * D, H, D, tiles)
    except (cl.Error, ClgptError):
        pass


def device_candidates(dev: Device, D: int, max_candidates: int | None = None) -> dict:
    """{kernel: the first max_candidates of its candidates that fit dev at head width D}."""
    lim = dev.device.max_work_group_size, dev.device.local_mem_size
    return {k: candidates(k, D, *lim)[:max_candidates] for k in DEFAULT}


def build_jobs(dev: Device, H: int, D: int, max_candidates: int | None = None, cands: dict | None = None) -> list:
    """The builds `tune` needs first, as callables: every candidate's program (the kernels at this head count and
    width, whatever B and T)."""
    cands = cands or device_candidates(dev, D, max_candidates)
    return [lambda k=k, t=t: _try_build(dev, k, H, D, t) for k in DEFAULT for t in cands[k]]


def tune(dev: Device, B: int, H: int, T: int, D: int, progress=print, budget_s: float = BUDGET_S,
         max_candidates: int | None = None, cands: dict | None = None, measure=None, batched=None) -> dict:
    """The flash attention record of `dev` at (B, H, T, D): each kernel's fastest candidate (of the first
    max_candidates that fit) that matches float64, ties to the earlier. progress(line) is told each kernel's choice;
    cands {kernel: [tiles]} replaces the candidates, measure(kernel, tiles) -> seconds the timed launches (tests).
    batched() -> seconds of the batched form's forward and backward at the same shape: the record's `form` is then
    the faster of the two (flash on a tie), else flash; `batched_seconds` is what that timing took, builds
    included (part of `seconds`)."""
    t0 = time.perf_counter()
    default = default_tiles(dev, H, D)
    run = Run(dev, B, H, T, D)
    measure = measure or run.time
    cands = cands or device_candidates(dev, D, max_candidates)
    run_builds(build_jobs(dev, H, D, cands=cands))  # the builds are most of a first run
    tiles, ms, rejected, flash_s = {}, {}, {}, 0.0
    for kernel in ("forward", "dq", "dkv"):  # dq writes the delta dk/dv reads; the forward the lse both read
        start, best = time.perf_counter(), None
        for t in cands[kernel]:
            if best is not None and time.perf_counter() - start > budget_s:
                break
            why = check(dev, H, D, kernel, t, default)
            if why:
                rejected[f"{kernel} {t}"] = why
                continue
            s = measure(kernel, t)
            ms[f"{kernel} {t}"] = round(s * 1e3, 4)
            if best is None or s < best[0]:
                best = (s, t)
        if best is None:
            raise ClgptError(f"flash attention tuning on {dev.name}: no {kernel} tiles work "
                             f"({next(iter(rejected.values()))}); set attention: batched")
        tiles[kernel] = list(best[1])
        flash_s += best[0]
        if kernel != "dkv":  # the next kernel reads what this one wrote with the chosen tiles
            run.launch(kernel, best[1])
        progress(f"flash attention {kernel}: tiles {best[1]} ({best[0] * 1e3:.3f} ms)")
    rec = dict(tiles=tiles, ms=ms, rejected=rejected, form="flash")
    if batched is not None:
        t_batched = time.perf_counter()
        batched_s = batched()
        rec.update(form="flash" if flash_s <= batched_s else "batched", flash_ms=round(flash_s * 1e3, 4),
                   batched_ms=round(batched_s * 1e3, 4), batched_seconds=round(time.perf_counter() - t_batched, 2))
        progress(f"attention forward and backward: flash {flash_s * 1e3:.3f} ms, batched {batched_s * 1e3:.3f} ms: "
                 f"{rec['form']}")
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def describe(tiles: dict) -> str:
    """The tiles a kernel, and the form where the record names one: "forward 64x32x4, dq ..., dkv ...; batched"."""
    return ", ".join(f"{k} {'x'.join(map(str, tiles[k]))}" for k in DEFAULT) + (
        f"; {tiles['form']}" if "form" in tiles else "")


def scores_too_big(device: cl.Device, cfg, batch_size: int, seq_len: int) -> bool:
    """Whether the batched form's saved scores (a B x H x T x T buffer a layer) would fill over SCORES_SHARE of the
    device's memory: flash then, untimed."""
    return cfg.n_layer * batch_size * cfg.n_head * seq_len * seq_len * 4 > SCORES_SHARE * device.global_mem_size


def wanted(device: cl.Device, launch_row: dict, T: int, kn: Knobs) -> bool:
    """Whether a run on this row takes portable flash attention at T on its own (attention: auto): a GPU whose
    row has the local-memory GEMM and no tensor cores under the knobs (the generic row), T at least MIN_T. (Every
    row names tensor-core tiles, used only where the matrix path says so.)"""
    return bool(device.type & cl.device_type.GPU) and launch_row.get("matmul", {}).get("kernel") == "matmul" \
        and matrix_path(device, kn) is None and T >= MIN_T


def resolve_beside(setting: str, dev: Device, key: str, what: str, fallback: str, unwanted: str, check,
                   describe, tune, announce: str, say=print, may_tune: bool = True) -> tuple[dict | None, str]:
    """The `tuning` setting -> (a record kept beside the GEMM's in its files, or None, the log's line "WHAT: ...") for
    portable flash attention's tiles and the row kernels' forms (clgpt.device.tuner_rows), as
    clgpt.device.tuner.resolve does for the GEMM. off: None; a path: its record under `key`, None where it has none;
    auto: None with the reason `unwanted` where it is not "", else the cache's record, or (may_tune) tune() saved
    into the cache after `announce` is said. check(record, where) -> what the run takes (or a one-line ClgptError
    naming where), describe(that) -> its words; fallback: what None means ("the defaults")."""
    if setting == "off":
        return None, f"{what}: tuning off ({fallback})"
    if setting != "auto":
        rec = tuner.read_file(Path(setting))["records"].get(key)
        if rec is None:
            return None, f"{what}: pinned file {setting} has none for this shape ({fallback})"
        got = check(rec, setting)
        return got, f"{what}: pinned file {setting} ({describe(got)})"
    if unwanted:
        return None, f"{what}: {fallback} ({unwanted})"
    path = tuner.cache_file(dev.device)
    rec = tuner.read_file(path)["records"].get(key) if path.exists() else None
    if rec is not None:
        got = check(rec, str(path))
        return got, f"{what}: cached: {path} ({describe(got)})"
    if not may_tune:
        return None, f"{what}: ranks read the cache only; run `clgpt tune-device` first ({fallback})"
    say(announce)
    rec = tune()
    tuner.save(path, dev.device, key, rec)
    got = check(rec, str(path))
    return got, f"{what}: tuned now in {rec['seconds']:.1f} s: {path} ({describe(got)})"


def resolve(setting: str, dev: Device, cfg, batch_size: int, seq_len: int, launch_row: dict, kn: Knobs,
            say=print, may_tune: bool = True, time_batched=None) -> tuple[dict | None, str]:
    """The stages' `tuning` setting -> (portable flash attention's tiles and form, or None: the defaults, the log's
    line), as clgpt.device.tuner.resolve does for the GEMM, in the same files. auto: tuned once where a run takes
    it (wanted), then cached; off: the defaults; a path: its record, the defaults where it has none.
    time_batched() -> seconds of the batched form at this shape (clgpt.ops.attention_seconds, from the caller's
    layer): tune weighs the flash kernels against it, unless the scores are too big to keep (scores_too_big)."""
    H, D = cfg.n_head, cfg.head_dim
    unwanted = "" if wanted(dev.device, launch_row, seq_len, kn) else \
        f"tuned only on a GPU's generic row, T >= {MIN_T}"

    def tuned() -> dict:
        big = scores_too_big(dev.device, cfg, batch_size, seq_len)
        return tune(dev, batch_size, H, seq_len, D, progress=say, batched=None if big else time_batched)

    return resolve_beside(
        (setting or "auto").strip(), dev, record_key(batch_size, H, seq_len, D), "flash attention tiles",
        "the defaults", unwanted, check_record, describe, tuned,
        f"tuning flash attention on {dev.name} at B {batch_size}, H {H}, T {seq_len}, D {D} ...", say, may_tune)

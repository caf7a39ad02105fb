"""The GPU row kernels' forms and their tuner: work-group sizes and sub-group reductions, checked against float64
numpy and timed on the user's device at the model's shapes, cached beside the GEMM's.

Two families, each a list of candidates (the table's choice first, so ties keep it):
  norm: LayerNorm's or RMSNorm's 32-wide row slices (kernels/norm_rows.cl; C % 128 == 0, C <= 2048): `ln_rw` rows a
        work-group (2, 4, 8) by their reduction (`sg`: "local" memory, or a fixed sub-group size dividing 32), timed
        as a forward and a backward over the model's B x T rows;
  rows: the one-work-group-a-row kernels (kernels/reduce.cl's wg_reduce): `rows` work-items a row (64, 128, 256) by
        their reduction ("local", a fixed sub-group size, or "auto": the compiler's), timed as cross-entropy's
        forward over B x T rows of V logits and, where batched attention runs (T below tuner_flash.MIN_T), its
        softmax and softmax backward over B x H x T rows of T.
A candidate that fails to build or to match float64 at odd sizes is left out. Sub-group forms change the order of a
row's sums: the record, like the device, decides the bytes; a pinned tuning file (clgpt.device.tuner) repeats a
run exactly. The record lives in the GEMM tuner's file under record_key: the shape and the row kernels' source hash.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pyopencl as cl

from clgpt.device import tuner, tuner_flash
from clgpt.device.builds import run_builds
from clgpt.device.capabilities import subgroup_sizes
from clgpt.device.knobs import Knobs
from clgpt.device.precision import matrix_path
from clgpt.device.opencl import KERNEL_DIR, Device, kernel_source
from clgpt.errors import ClgptError

LOCAL, AUTO = "local", "auto"
LN_RW = (4, 2, 8)  # the table's 4 first
ROWS = (128, 64, 256)  # the table's 128 first
TIMED_REPS = 3
BUDGET_S = 5.0  # a family's candidates past this are not timed (a slow device still gets a record)
CHECK_TOL = 1e-5  # max |err| / max |ref| of a row's fp32 sums (about 1e-7 when right)
FILES = ("reduce", "norm_rows", "layernorm", "rmsnorm", "attention", "xent")


def _reductions(device, at_most: int, row_slices: bool) -> list:
    """"local", then the sub-group sizes the device builds (each up to `at_most`; for the row slices those dividing
    32, and only fixed ones), or AUTO where the compiler picks its size."""
    sizes, fixed = subgroup_sizes(device)
    if not fixed:
        return [LOCAL] + ([AUTO] if sizes and not row_slices else [])
    return [LOCAL] + [n for n in sizes if n <= at_most and (not row_slices or 32 % n == 0)]


def candidates(dev: Device, C: int) -> dict:
    """{family: [candidate dict]} that fit the device; norm is [] where the row slices do not take C."""
    most = dev.device.max_work_group_size
    norm = [dict(ln_rw=rw, sg=sg) for rw in LN_RW if 32 * rw <= most for sg in _reductions(dev.device, 32, True)]
    rows = [dict(rows=lw, sg=sg) for lw in ROWS if lw <= most for sg in _reductions(dev.device, lw, False)]
    return dict(norm=norm if C % 128 == 0 and C <= 2048 else [], rows=rows)


def sub_group(sg) -> dict:
    """A candidate's reduction as build options: {} local memory, {SUBGROUP: n} (0: the compiler's size)."""
    return {} if sg == LOCAL else dict(SUBGROUP=0 if sg == AUTO else int(sg))


class Run:
    """Buffers of one model shape's row kernels, and their launches with a candidate's form."""

    def __init__(self, dev: Device, arch: str, N: int, C: int, V: int, R: int, T: int, seed: int = 0):
        self.dev, self.arch, self.N, self.C, self.V, self.R, self.T = dev, arch, N, C, V, R, T
        r = np.random.default_rng(seed)
        normal = lambda shape, s=1.0: r.standard_normal(shape, np.float32) * np.float32(s)  # noqa: E731
        self.host = dict(x=normal((N, C), 2) + np.float32(0.5), w=normal(C), b=normal(C), dout=normal((N, C)),
                         logits=normal((N, V), 4), targets=r.integers(0, V, N).astype(np.int32), att=normal((R, T), 3))
        mf = cl.mem_flags
        self.buf = {k: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a) for k, a in self.host.items()}
        for name, n in (("out", N * C), ("dx", N * C), ("mean", N), ("rstd", N), ("losses", N), ("lse", N),
                        ("mask", N), ("part", 2 * N * C), ("datt", R * T), ("dp", R * T)):
            self.buf[name] = cl.Buffer(dev.ctx, mf.READ_WRITE, max(1, n) * 4)
        cl.enqueue_fill_buffer(dev.queue, self.buf["mask"], np.float32(1), 0, N * 4)
        cl.enqueue_fill_buffer(dev.queue, self.buf["dp"], np.float32(0), 0, max(1, R * T) * 4)

    def norm(self, cand: dict, backward: bool = True) -> None:
        """The norm's row-slice forward (and backward: dx and one part a work-group, rpi 1) with `cand`."""
        ln, N, C, b, i32 = self.arch == "gpt2", self.N, self.C, self.buf, np.int32
        rw, file = cand["ln_rw"], "layernorm" if self.arch == "gpt2" else "rmsnorm"
        kw = dict(C=C, EPS=1e-5, RW=rw, **sub_group(cand["sg"]))
        stats = (b["mean"], b["rstd"]) if ln else (b["rstd"],)
        fwd = self.dev.kernel(file, f"{file}_forward_rows", **kw)
        fwd(self.dev.queue, (32, -(-N // rw) * rw), (32, rw), i32(N), b["x"], b["w"], *((b["b"],) if ln else ()),
            b["out"], *stats)
        if backward:
            bwd = self.dev.kernel(file, f"{file}_backward_rows", **kw)
            bwd(self.dev.queue, (32, -(-N // rw) * rw), (32, rw), i32(N), i32(1), i32(0), b["dout"], b["x"], b["w"],
                *stats, b["dx"], b["part"])

    def rows(self, cand: dict, softmax: bool = True) -> None:
        """Cross-entropy's forward and (softmax) attention's softmax and its backward with `cand`."""
        lw, b, q, i32 = cand["rows"], self.buf, self.dev.queue, np.int32
        sg = sub_group(cand["sg"])
        self.dev.kernel("xent", "xent_forward_wg", V=self.V, LW=lw, **sg)(
            q, (self.N * lw,), (lw,), i32(self.N), b["logits"], b["targets"], b["mask"], b["losses"], b["lse"])
        if softmax:
            kw = dict(C=8, H=1, D=8, SCALE=1.0, VEC=0, LW=lw, **sg)
            cl.enqueue_copy(q, b["datt"], b["att"])  # datt: the probabilities, dp: the backward's gradient
            self.dev.kernel("attention", "attention_softmax", **kw)(q, (self.R * lw,), (lw,), i32(self.T), b["datt"])
            self.dev.kernel("attention", "attention_dsoftmax", **kw)(q, (self.R * lw,), (lw,), i32(self.T), b["datt"],
                                                                     b["dp"])

    def read(self, name: str, shape) -> np.ndarray:
        out = np.empty(shape, np.float32)
        cl.enqueue_copy(self.dev.queue, out, self.buf[name], is_blocking=True)
        return out


def check(dev: Device, arch: str, C: int, V: int, family: str, cand: dict) -> str:
    """"" where `cand` matches float64 at odd sizes (37 rows; 2 x 75 softmax rows of 75), else why not."""
    run = Run(dev, arch, 37, C, min(V, 1003), 150, 75, seed=1)
    try:
        if family == "norm":
            run.norm(cand, backward=False)
            got, x = run.read("out", (37, C)).astype(np.float64), run.host["x"].astype(np.float64)
            if arch == "gpt2":
                xh = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
                want = xh * run.host["w"] + run.host["b"]
            else:
                want = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * run.host["w"]
            errs = [np.abs(got - want).max() / np.abs(want).max()]
        else:
            run.rows(cand)
            lg = run.host["logits"][:, :run.V].astype(np.float64)
            lse = lg.max(1) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1))
            s = run.host["att"].astype(np.float64)
            s[np.arange(75)[None, :] > (np.arange(150) % 75)[:, None]] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            errs = [np.abs(run.read("lse", 37) - lse).max() / np.abs(lse).max(),
                    np.abs(run.read("datt", (150, 75)) - p).max() / p.max()]
    except (cl.Error, ClgptError) as e:
        return f"fails to build or launch ({str(e).splitlines()[0][:80]})"
    err = max(errs)
    return "" if err <= CHECK_TOL else f"disagrees with float64 numpy (max rel err {err:.2e})"


def _try_build(dev: Device, cfg, family: str, cand: dict) -> None:
    """Build one candidate's programs, leaving a failure for its check to meet again and reject."""
    sg = sub_group(cand["sg"])
    try:
        if family == "norm":
            file = "layernorm" if cfg.arch == "gpt2" else "rmsnorm"
            dev.kernel(file, f"{file}_forward_rows", C=cfg.n_embd, EPS=1e-5, RW=cand["ln_rw"], **sg)
        else:
            dev.kernel("xent", "xent_forward_wg", V=cfg.vocab_size, LW=cand["rows"], **sg)
            dev.kernel("attention", "attention_softmax", C=8, H=1, D=8, SCALE=1.0, VEC=0, LW=cand["rows"], **sg)
    except (cl.Error, ClgptError):
        pass


def build_jobs(dev: Device, cfg, cands: dict | None = None) -> list:
    """The builds `tune` needs first, as callables: every candidate's programs."""
    cands = cands or candidates(dev, cfg.n_embd)
    return [lambda f=f, c=c: _try_build(dev, cfg, f, c) for f in cands for c in cands[f]]


def describe_form(family: str, cand: dict | None) -> str:
    if cand is None:
        return f"{family}: the table's"
    size = cand["ln_rw"] if family == "norm" else cand["rows"]
    what = "rows a work-group" if family == "norm" else "work-items a row"
    sg = cand["sg"]
    return f"{family} {size} {what}, {sg if sg in (LOCAL, AUTO) else f'sub-groups of {sg}'}"


def describe(record: dict) -> str:
    return "; ".join(describe_form(f, record.get(f)) for f in ("norm", "rows"))


def tune(dev: Device, cfg, B: int, T: int, progress=print, cands: dict | None = None, measure=None,
         budget_s: float = BUDGET_S) -> dict:
    """The row kernels' record of `dev` for model `cfg` at batch B, context T: each family's fastest candidate that
    matches float64 (of those reached within budget_s of the family's start), ties to the earlier (the table's
    first). cands replaces candidates(); measure(family, cand) -> seconds replaces the timed launches (tests)."""
    t0 = time.perf_counter()
    C, V, N, R = cfg.n_embd, cfg.vocab_size, B * T, B * cfg.n_head * T
    softmax = T < tuner_flash.MIN_T
    run = Run(dev, cfg.arch, N, C, V, R if softmax else 1, T if softmax else 1)

    def timed(family, cand):
        launch = (lambda: run.norm(cand)) if family == "norm" else (lambda: run.rows(cand, softmax))
        launch()
        dev.queue.finish()
        best = float("inf")
        for _ in range(TIMED_REPS):
            start = time.perf_counter()
            launch()
            dev.queue.finish()
            best = min(best, time.perf_counter() - start)
        return best

    measure = measure or timed
    cands = cands or candidates(dev, C)
    run_builds(build_jobs(dev, cfg, cands))  # the builds are most of a first run
    record, ms, rejected = {}, {}, {}
    for family in ("norm", "rows"):
        best, start = None, time.perf_counter()
        for cand in cands[family]:
            if best is not None and time.perf_counter() - start > budget_s:
                break
            name = describe_form(family, cand)
            why = check(dev, cfg.arch, C, V, family, cand)
            if why:
                rejected[name] = why
                continue
            s = measure(family, cand)
            ms[name] = round(s * 1e3, 4)
            if best is None or s < best[0]:
                best = (s, cand)
        record[family] = None if best is None else dict(best[1])
        progress(f"row kernels: {describe_form(family, record[family])}"
                 + (f" ({best[0] * 1e3:.3f} ms)" if best else ""))
    return dict(record, ms=ms, rejected=rejected, seconds=round(time.perf_counter() - t0, 2))


def source_hash() -> str:
    return hashlib.sha256("".join(kernel_source(KERNEL_DIR / f"{f}.cl") for f in FILES).encode()).hexdigest()[:12]


def record_key(cfg, B: int, T: int) -> str:
    """The record's name in a tuning file: the shapes it was timed at and the row kernels' source hash."""
    return f"rows:{source_hash()}:{cfg.arch}:B{B}T{T}C{cfg.n_embd}H{cfg.n_head}V{cfg.vocab_size}"


def check_record(record, where: str) -> dict:
    """`record` if its families name forms, else a one-line ClgptError naming `where`."""
    try:
        ok = (record["rows"] is None or int(record["rows"]["rows"]) > 0) and \
             (record["norm"] is None or int(record["norm"]["ln_rw"]) > 0)
        ok = ok and all(r is None or r["sg"] in (LOCAL, AUTO) or int(r["sg"]) > 0
                        for r in (record["rows"], record["norm"]))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ClgptError(f"tuning file {where}: a row kernels' record names no forms; run `clgpt tune-device` again "
                         "or set tuning: off")
    return record


def wanted(device: cl.Device, launch_row: dict, kn: Knobs) -> bool:
    """Whether a run on this row tunes its row kernels on its own (tuning: auto): a GPU whose row has them and no
    tensor cores under the knobs (the generic row, which the GPUs without NVIDIA's kernels run; NVIDIA's own row
    keeps its table)."""
    return bool(device.type & cl.device_type.GPU) and bool(launch_row.get("rows")) and matrix_path(device, kn) is None


def resolve(setting: str, dev: Device, cfg, batch_size: int, seq_len: int, launch_row: dict, kn: Knobs, say=print,
            may_tune: bool = True) -> tuple[dict | None, str]:
    """The stages' `tuning` setting -> (the row kernels' record or None: the table's forms, the log's line), as
    clgpt.device.tuner_flash.resolve does for flash attention, in the same files."""
    unwanted = "" if wanted(dev.device, launch_row, kn) else "tuned only on a GPU's generic row"
    return tuner_flash.resolve_beside(
        (setting or "auto").strip(), dev, record_key(cfg, batch_size, seq_len), "row kernels", "the table's forms",
        unwanted, check_record, describe, lambda: tune(dev, cfg, batch_size, seq_len, progress=say),
        f"tuning the row kernels on {dev.name} at B {batch_size}, T {seq_len} ...", say, may_tune)

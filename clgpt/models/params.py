"""ParamStore: the model's parameters, gradients and AdamW state as flat device buffers, and the optimizer.

Each of parameters, grads, m, v is one flat buffer, each tensor a sub-buffer at an aligned offset, tensors
that decay first; so zero_grad is one fill, the grad norm one two-stage reduction and AdamW one launch.
The order (decaying tensors, then the rest, each group in param_shapes order) is also the order of
`get_grads_flat` / `set_grads_flat` (no padding: n_params floats). Data-parallel ranks sum the padded
layout itself (n_flat floats, padding zero on every rank) a layer at a time during the backward pass:
`read_grads_async` copies tensors' gradients into page-locked host memory (`pinned`) behind the kernels
that made them, and `write_grads` puts the sums back in one copy (clgpt.training.dist.OverlappedReduce).

`trains` (a predicate; default all): tensors it rejects come last, from n_train on, where the grad norm and
AdamW never reach: they keep their values (gpt2 with model.bias off: biases stay zero, as if absent).

`optimizer=False` makes the store without AdamW moments (a frozen base under adapters, clgpt.models.lora): step
refuses, and the optimizer state is empty.

`muon` {tensor name: (count, rows, cols)} (clgpt.model.muon_matrices) puts those tensors first in the store, from 0
to n_muon, each `count` matrices of (rows, cols): `step` with a `muon` settings dict gives them Muon (clgpt/ops/muon.py:
momentum in m, their v unused; the matrices of one shape orthogonalised together, `muon_shapes`) and AdamW only
the rest, n_muon to n_train. Without `muon` the layout is as before.

`packed` {view name: (tensor names, consecutive in that order)} lays those tensors back to back, with no
padding between them, and adds a view of the whole run under the view name: one product can then use them
as one matrix (llama: attn_q | attn_k | attn_v, ffn_gate | ffn_up). A member that then starts off the
device's sub-buffer alignment has no view of its own (only the packed one).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from clgpt.errors import ClgptError
from clgpt.ops import F32, Ops, ceil_to
from clgpt.ops.muon import Muon, lr_scale


class ParamStore:
    def __init__(self, ops: Ops, shapes: dict[str, tuple], decays, packed: dict[str, tuple] | None = None,
                 trains=lambda name: True, optimizer: bool = True, muon: dict | None = None):
        self.ops, self.queue, self.shapes = ops, ops.queue, shapes
        self.muon = dict(muon or {}) if optimizer else {}
        bad = [n for n in self.muon if not (trains(n) and decays(n))]
        if bad:
            raise ValueError(f"Muon tensors must train and decay: {bad}")
        # Muon's tensors first (they all decay), so they span 0..n_muon and AdamW runs on one range after them
        shapes = {n: shapes[n] for n in sorted(shapes, key=lambda n: n not in self.muon)}
        names = ([n for n in shapes if trains(n) and decays(n)] + [n for n in shapes if trains(n) and not decays(n)]
                 + [n for n in shapes if not trains(n)])
        self.packed = dict(packed or {})
        follows = {}  # member -> the member before it in its packed run
        for view, members in self.packed.items():
            i = names.index(members[0])
            if tuple(names[i: i + len(members)]) != tuple(members):
                raise ValueError(f"packed view {view}: {members} are not consecutive in the store's order")
            follows.update(zip(members[1:], members[:-1]))
        self.offsets, off, self.n_decay, self.n_train = {}, 0, 0, 0
        for name in names:
            if name in follows:  # right after the previous member
                prev = follows[name]
                off = self.offsets[prev] + int(np.prod(shapes[prev]))
            self.offsets[name] = off
            off = ceil_to(off + int(np.prod(shapes[name])), ops.align)
            if decays(name) and trains(name):
                self.n_decay = off
            if trains(name):
                self.n_train = off
        self.n_flat, self.order = off, names
        self.n_muon = max((ceil_to(self.offsets[n] + int(np.prod(shapes[n])), ops.align) for n in self.muon), default=0)
        self.n_params = sum(int(np.prod(shapes[n])) for n in names)
        self.flat_p, self.flat_g = ops.buf(self.n_flat), ops.buf(self.n_flat)
        self.flat_m = self.flat_v = None
        if optimizer:
            self.flat_m, self.flat_v = ops.buf(self.n_flat), ops.buf(self.n_flat)
        self.p, self.g = self._views(self.flat_p), self._views(self.flat_g)
        self.n_parts = min(ops.launch["norm_parts"], max(1, self.n_train // 1024))
        self.chunk = -(-self.n_train // self.n_parts)
        self.partials, self.norm_buf = ops.buf(self.n_parts), ops.buf(2)
        self.t = 0
        self._muon = self._adamw_bufs = None
        if self.muon:
            self._muon = Muon(ops)
            self._u = ops.buf(self.n_muon)  # the momentum's update, orthogonalised a shape at a time
            # (rows, cols) -> every Muon matrix of that shape's offset (tensors in store order, experts in order)
            self.muon_shapes = {}
            for name, (count, rows, cols) in self.muon.items():
                self.muon_shapes.setdefault((rows, cols), []).extend(
                    self.offsets[name] + e * rows * cols for e in range(count))
            sub = lambda b: b.get_sub_region(self.n_muon * F32, max(1, self.n_flat - self.n_muon) * F32)  # noqa: E731
            self._adamw_bufs = tuple(sub(b) for b in (self.flat_p, self.flat_g, self.flat_m, self.flat_v))

    def offset(self, name: str) -> int:
        """Where tensor or packed view `name` starts in the flat buffers, in floats."""
        return self.offsets[self.packed[name][0] if name in self.packed else name]

    def _views(self, flat: cl.Buffer) -> dict[str, cl.Buffer]:
        base = max(1, self.ops.dev.device.mem_base_addr_align // 8)  # bytes a sub-buffer's offset must divide by
        size = lambda n: int(np.prod(self.shapes[n])) * F32  # noqa: E731
        views = {n: flat.get_sub_region(self.offsets[n] * F32, size(n)) for n in self.order
                 if self.offsets[n] * F32 % base == 0}
        for view, members in self.packed.items():
            views[view] = flat.get_sub_region(self.offsets[members[0]] * F32, sum(size(n) for n in members))
        return views

    # ---- gradients and the optimizer ----
    def zero_grad(self):
        cl.enqueue_fill_buffer(self.queue, self.flat_g, np.float32(0), 0, self.n_flat * F32)

    def _norm(self, clip: float):
        self.ops.grad_norm(self.n_train, self.chunk, self.n_parts, self.flat_g, self.partials, clip, self.norm_buf)

    def grad_norm(self) -> float:
        self._norm(0.0)
        out = np.empty(2, np.float32)
        cl.enqueue_copy(self.queue, out, self.norm_buf, is_blocking=True)
        return float(out[0])

    def step(self, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, muon: dict | None = None) -> float:
        """Clip grads to global norm `clip` (clip <= 0: no clipping), one AdamW step; -> pre-clip norm.
        A store made with Muon tensors takes `muon` (the schema's muon settings, its lr already scheduled) and
        gives those tensors a Muon step (clgpt/ops/muon.py), the others AdamW."""
        if self.flat_m is None:
            raise ClgptError("this parameter store is frozen (made with optimizer=False); train its adapters")
        if bool(self.muon) != (muon is not None):
            raise ClgptError("this parameter store was made " + ("with" if self.muon else "without")
                             + " Muon tensors; step takes muon settings exactly when it has them")
        self._norm(float(clip))
        self.t += 1
        bc1, bc2 = 1.0 - beta1**self.t, 1.0 - beta2**self.t
        if self.muon:
            self._muon_step(muon)
            p, g, m, v = self._adamw_bufs
            if self.n_train > self.n_muon:
                self.ops.adamw(self.n_train - self.n_muon, self.n_decay - self.n_muon, p, g, m, v, self.norm_buf,
                               lr, beta1, beta2, bc1, bc2, eps, weight_decay)
        else:
            self.ops.adamw(self.n_train, self.n_decay, self.flat_p, self.flat_g, self.flat_m, self.flat_v,
                           self.norm_buf, lr, beta1, beta2, bc1, bc2, eps, weight_decay)
        out = np.empty(2, np.float32)
        cl.enqueue_copy(self.queue, out, self.norm_buf, is_blocking=True)
        return float(out[0])

    def _muon_step(self, s: dict):
        """Momentum over all Muon tensors (the clip factor applied), then the matrices of each shape orthogonalised
        together and applied (the lr's scale depends on the shape alone)."""
        mu = self._muon
        mu.momentum(self.n_muon, s["momentum"], s["nesterov"], self.flat_g, self.flat_m, self._u, self.norm_buf)
        decay = 1.0 - s["lr"] * s["weight_decay"]
        for (rows, cols), offs, o in mu.orthogonalized(self._u, self.muon_shapes, s["ns_steps"]):
            mu.update(offs, rows, cols, self.flat_p, o, decay, s["lr"] * lr_scale(s["lr_scale"], rows, cols))

    # ---- host access ----
    def _read(self, buf) -> np.ndarray:
        flat = np.empty(self.n_flat, np.float32)
        cl.enqueue_copy(self.queue, flat, buf, is_blocking=True)
        return flat

    def _read_flat(self, buf) -> dict[str, np.ndarray]:
        flat = self._read(buf)
        return {n: flat[self.offsets[n]: self.offsets[n] + int(np.prod(s))].reshape(s).copy()
                for n, s in self.shapes.items()}

    def _write_flat(self, buf, d: dict, what: str):
        flat = np.zeros(self.n_flat, np.float32)
        missing = set(self.shapes) - set(d)
        extra = set(d) - set(self.shapes)
        if missing or extra:
            raise ClgptError(f"{what}: missing tensors {sorted(missing)}, unexpected tensors {sorted(extra)}")
        for n, s in self.shapes.items():
            a = np.asarray(d[n], dtype=np.float32)
            if a.shape != s:
                raise ClgptError(f"{what}: tensor {n} has shape {a.shape}; the model expects {s}")
            flat[self.offsets[n]: self.offsets[n] + a.size] = a.reshape(-1)
        cl.enqueue_copy(self.queue, buf, flat, is_blocking=True)

    def get_params(self) -> dict[str, np.ndarray]:
        return self._read_flat(self.flat_p)

    def set_params(self, d: dict):
        self._write_flat(self.flat_p, d, "params")

    def get_grads(self) -> dict[str, np.ndarray]:
        return self._read_flat(self.flat_g)

    def get_grads_flat(self) -> np.ndarray:
        """float32 (n_params,): every gradient, in the store's fixed order, without the alignment padding."""
        flat = self._read(self.flat_g)
        return np.concatenate([flat[self.offsets[n]: self.offsets[n] + int(np.prod(self.shapes[n]))]
                               for n in self.order])

    def set_grads_flat(self, a: np.ndarray):
        """The inverse of get_grads_flat (e.g. after an all-reduce)."""
        a = np.asarray(a, dtype=np.float32).reshape(-1)
        if a.size != self.n_params:
            raise ClgptError(f"set_grads_flat: got {a.size} values; the model has {self.n_params} parameters")
        flat, i = np.zeros(self.n_flat, np.float32), 0
        for n in self.order:
            size = int(np.prod(self.shapes[n]))
            flat[self.offsets[n]: self.offsets[n] + size] = a[i: i + size]
            i += size
        cl.enqueue_copy(self.queue, self.flat_g, flat, is_blocking=True)

    # ---- the padded layout, for data-parallel ranks (clgpt.training.dist.OverlappedReduce) ----
    def pinned(self, n: int) -> np.ndarray:
        """float32 (n,) host array in page-locked memory (a mapped CL_MEM_ALLOC_HOST_PTR buffer, kept mapped):
        device copies to and from it run at DMA speed on a GPU, where pageable numpy memory is copied through
        a staging buffer (several times slower); on a CPU device it is plain host memory."""
        mf = cl.mem_flags
        buf = cl.Buffer(self.ops.ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, max(1, n) * F32)
        arr, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0, (max(1, n),),
                                       np.float32, is_blocking=True)
        self.__dict__.setdefault("_pinned", []).append((buf, arr))  # the buffer lives as long as the store
        return arr[:n]

    def padded_spans(self, names) -> list[tuple[int, int]]:
        """[start, end) of the named tensors in the padded layout, each with the padding behind it (zero in
        the gradients), neighbours merged."""
        ends = {n: (self.offsets[m] if k + 1 < len(self.order) else self.n_flat)
                for k, (n, m) in enumerate(zip(self.order, self.order[1:] + [None]))}
        spans = []
        for a, b in sorted((self.offsets[n], ends[n]) for n in names):
            if spans and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
        return spans

    def read_grads_async(self, names, host: np.ndarray) -> cl.Event:
        """Enqueue copies of the named tensors' gradients into their spans of `host` (n_flat floats, the
        padded layout) behind the kernels already enqueued; -> an event that completes when they are there."""
        for a, b in self.padded_spans(names):
            cl.enqueue_copy(self.queue, host[a:b], self.flat_g, src_offset=a * F32, is_blocking=False)
        return cl.enqueue_marker(self.queue)

    def write_grads(self, host: np.ndarray):
        """Replace every gradient by `host` (n_flat floats, the padded layout) in one copy; the caller keeps
        `host` unchanged until the queue has run it (the next blocking read, e.g. step's norm)."""
        cl.enqueue_copy(self.queue, self.flat_g, host[: self.n_flat], is_blocking=False)

    def get_optimizer_state(self) -> dict:
        if self.flat_m is None:
            return {"t": self.t}
        return {"m": self._read_flat(self.flat_m), "v": self._read_flat(self.flat_v), "t": self.t}

    def set_optimizer_state(self, s: dict | None):
        """None resets m, v to zero and t to 0."""
        if self.flat_m is None:
            self.t = 0 if s is None else int(s["t"])
            return
        if s is None:
            for buf in (self.flat_m, self.flat_v):
                cl.enqueue_fill_buffer(self.queue, buf, np.float32(0), 0, self.n_flat * F32)
            self.t = 0
            return
        self._write_flat(self.flat_m, s["m"], "optimizer state m")
        self._write_flat(self.flat_v, s["v"], "optimizer state v")
        self.t = int(s["t"])

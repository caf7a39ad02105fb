"""The engine base: what every architecture shares (clgpt.models.factory.make_engine picks the architecture).

An engine is three parts, as in llm.c: the launchers (`clgpt.ops.Ops`: which kernel, tiles and launch a
device gets), the parameter store with AdamW (`clgpt.models.params.ParamStore`), and the model's forward and
backward written against the launchers (`clgpt.models.gpt2.GPT2Engine`, `clgpt.models.llama.LlamaEngine`). This base
holds the parts every model has: token checks, the logits and loss ending of the forward, the backward's
head (cross-entropy gradient and the output projection, label-smoothed where the engine trains so), the
token-embedding gradient and dropout's state.

Shapes: B batch, T time, N = B*T rows, C n_embd, V vocab. Activations are allocated once for (batch_size,
seq_len); a call with B' <= B, T' <= T uses the first B'*T' rows. Within a step only the loss (and the
norm in step) comes back to the host.
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from clgpt.device.opencl import Device, resolve_device
from clgpt.errors import ClgptError
from clgpt.device.knobs import Knobs
from clgpt.device.precision import resolve as resolve_precision
from clgpt.model import ModelConfig, decays, muon_matrices, param_shapes, trains
from clgpt.models.params import ParamStore
from clgpt.ops import Ops


class EngineBase:
    arch = ""
    saved: tuple[str, ...] = ()  # the per-layer activations (self.acts keys) the backward reads again as operands
    # grad_hook(i), when set, is called inside backward() right after layer i's gradient kernels are enqueued
    # (layers n_layer-1 .. 0): from then on blk.i.*'s gradients of this backward are final, so data-parallel
    # ranks can start summing them while the layers below still run (clgpt.training.dist.OverlappedReduce).
    grad_hook = None

    def __init__(self, cfg: ModelConfig, params: dict, batch_size: int, seq_len: int,
                 device: Device | str | None = None, dropout: float = 0.0, precision: str = "fp32",
                 optimizer: bool = True, *, knobs: Knobs, attention: str = "auto", muon: bool = False,
                 label_smoothing: float = 0.0):
        cfg.validate()
        if cfg.arch != self.arch:
            raise ClgptError(f"{type(self).__name__} runs arch {self.arch!r}, not {cfg.arch!r}; "
                             f"use clgpt.models.factory.make_engine")
        if seq_len > cfg.n_ctx:
            raise ClgptError(f"seq_len {seq_len} exceeds the model's n_ctx {cfg.n_ctx}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ClgptError(f"dropout must lie in [0, 1), got {dropout}")
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ClgptError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
        self.cfg, self.B, self.T, self.dropout = cfg, int(batch_size), int(seq_len), float(dropout)
        self.label_smoothing = float(label_smoothing)
        self.dev = resolve_device(device)
        self.ctx, self.queue = self.dev.ctx, self.dev.queue
        # the matmuls' precision, resolved once where the device is made ("auto" -> the device's best)
        self.precision = resolve_precision(precision, self.dev.device, knobs)
        self.ops = Ops(self.dev, cfg, self.T, self.precision, batch_size=self.B, knobs=knobs, attention=attention,
                       label_smoothing=self.label_smoothing)
        self.round, self.mma = self.ops.round, self.ops.mma  # its ROUND and tensor-core tiles
        self.shapes = param_shapes(cfg)
        self.store = ParamStore(self.ops, self.shapes, decays, self._packed(), trains=trains(cfg), optimizer=optimizer,
                                muon=muon_matrices(cfg) if muon else None)
        self.p, self.g = self.store.p, self.store.g
        self.ops.stable(*self.p.values())  # the weights change only between a backward and the next forward
        self._alloc_common()
        self._alloc()
        # written once a forward, read until its backward ends: the launchers may keep derived copies of them
        self.ops.stable(*(a[k] for a in self.acts for k in self.saved if k in a))
        self.ops.weight_copies(self.B * self.T, self.store.flat_p, [(self.p[n], self.store.offset(n), rows, cols)
                                                                    for n, rows, cols in self._product_weights()])
        self._fwd = None  # (B', T', sum(mask), dropout, smoothed) of the last forward with targets
        self._with_targets = False  # whether the forward running has targets (a loss; its backward may follow)
        self.set_params(params)
        self.set_optimizer_state(None)
        self.zero_grad()

    def _alloc_common(self):
        cfg, N = self.cfg, self.B * self.T
        C, V, buf = cfg.n_embd, cfg.vocab_size, self.ops.buf
        ib = lambda n: cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, max(1, n) * 4)  # noqa: E731
        self.tokens, self.targets, self.mask = ib(N), ib(N), buf(N)
        self.emb_order, self.emb_rows, self.emb_starts = ib(N), ib(N), ib(N + 1)
        self.x_out = buf(N * C)  # residual stream after the last block
        self.lnf = buf(N * C)  # its final norm, the output projection's input
        self.logits, self.losses, self.lse = buf(N * V), buf(N), buf(N)
        self.dlogits, self.dx, self.dln = buf(N * V), buf(N * C), buf(N * C)
        self.losses_host = np.empty(N, np.float32)
        self.ops.stable(self.lnf)
        self._last_rows = buf(self.B * C)  # next_logits: the final-norm rows of the positions asked for

    # ---- what an architecture writes ----
    def _packed(self) -> dict:
        """{view: tensor names} the parameter store lays back to back (clgpt.models.params.ParamStore)."""
        return {}

    def _alloc(self):
        raise NotImplementedError

    def _product_weights(self) -> list[tuple[str, int, int]]:
        """(tensor or packed view, rows, cols) of every weight the products read as it lies: the output
        projection's here, the blocks' in each architecture."""
        return [("token_embd.weight" if self.cfg.tied else "output.weight", self.cfg.vocab_size, self.cfg.n_embd)]

    def _forward_body(self, Bp: int, Tp: int):
        """Embedding, blocks and final norm: leaves rms/layer-normed x in self.lnf (N,C)."""
        raise NotImplementedError

    def _backward_body(self, Bp: int, Tp: int, scale: float):
        """From dln (N,C) = dloss/dlnf to every parameter gradient."""
        raise NotImplementedError

    # ---- the engine interface (ARCHITECTURE.md) ----
    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm] through this device's launchers."""
        self.ops.matmul(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def _check(self, a, name, Bp, Tp, dtype):
        a = np.ascontiguousarray(a, dtype=dtype)
        if a.shape != (Bp, Tp):
            raise ClgptError(f"{name} has shape {a.shape}; expected ({Bp}, {Tp}) like tokens")
        return a

    def _check_tokens(self, tokens) -> np.ndarray:
        """tokens as contiguous int32 (B', T'), B' <= B, T' <= T, ids inside the vocabulary."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[0] > self.B or tokens.shape[1] > self.T or tokens.size == 0:
            raise ClgptError(f"tokens shape {tokens.shape} must be (B', T') with B' <= {self.B}, T' <= {self.T}")
        V = self.cfg.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise ClgptError(f"token ids must lie in [0, {V}); got {tokens.min()}..{tokens.max()}")
        return tokens

    def _run_body(self, tokens: np.ndarray, drop):
        """Checked tokens (B', T') to the device, this forward's dropout (seed, p) or None, then the body into lnf."""
        self._drop = drop
        self.ops.forget_copies()  # the stable buffers are about to be written again
        cl.enqueue_copy(self.queue, self.tokens, tokens, is_blocking=False)
        self._tokens_host = tokens  # keeps the host array alive during the non-blocking copy
        self._forward_body(*tokens.shape)

    def forward(self, tokens, targets=None, mask=None, dropout_seed=None, smoothed=True):
        """Mean masked NLL (float) when targets are given, else logits (B', T', V) float32.
        Dropout (the engine's `dropout` > 0) is on only with targets and a dropout_seed (a uint32, see
        clgpt.models.dropout.dropout_seed): masks are a hash of (dropout_seed, site, element).
        Label smoothing (the engine's `label_smoothing` > 0): the loss, and the next backward's gradient, are
        torch's cross_entropy(label_smoothing=eps) unless smoothed=False (a held-out loss: the plain NLL)."""
        cfg = self.cfg
        tokens = self._check_tokens(tokens)
        Bp, Tp = tokens.shape
        on = self.dropout > 0 and targets is not None and dropout_seed is not None
        self._with_targets = targets is not None
        self._run_body(tokens, (int(dropout_seed) & 0xFFFFFFFF, self.dropout) if on else None)
        N = Bp * Tp
        self.ops.head_logits(N, cfg.n_embd, self.lnf, self._w_out(), self.logits, for_loss=targets is not None)
        return self._loss(Bp, Tp, targets, mask, smoothed and self.label_smoothing > 0)

    def next_logits(self, tokens, last) -> np.ndarray:
        """Logits (B', V) of row b at position last[b]: what forward(tokens)[b, last[b]] holds, bit for bit (the
        output projection of those rows alone sums each logit over the channels as the whole projection does),
        without computing or reading back the other positions' logits. Greedy decoding's step."""
        cfg, q = self.cfg, self.queue
        tokens = self._check_tokens(tokens)
        Bp, Tp = tokens.shape
        last = np.asarray(last, dtype=np.int64)
        if last.shape != (Bp,) or last.min() < 0 or last.max() >= Tp:
            raise ClgptError(f"last must hold one position in [0, {Tp}) per row ({Bp} rows)")
        self._fwd = None
        self._with_targets = False
        self._run_body(tokens, None)
        C, V = cfg.n_embd, cfg.vocab_size
        for b in range(Bp):  # the final-norm rows (N, C) of those positions, gathered
            cl.enqueue_copy(q, self._last_rows, self.lnf, byte_count=C * 4, src_offset=int(b * Tp + last[b]) * C * 4,
                            dst_offset=b * C * 4)
        self.ops.head_logits(Bp, C, self._last_rows, self._w_out(), self.logits, for_loss=False)
        out = np.empty((Bp, V), np.float32)
        cl.enqueue_copy(q, out, self.logits, is_blocking=True)
        return out

    def _loss(self, Bp, Tp, targets, mask, smoothed: bool):
        """Logits back to the host when there are no targets, else the masked mean loss (per-token losses
        summed on the host in float64, in a fixed order), label-smoothed when `smoothed`."""
        q, V, N = self.queue, self.cfg.vocab_size, Bp * Tp
        if targets is None:
            self._fwd = None
            out = np.empty((Bp, Tp, V), np.float32)
            cl.enqueue_copy(q, out, self.logits, is_blocking=True)
            return out
        targets = self._check(targets, "targets", Bp, Tp, np.int32)
        mask = np.ones((Bp, Tp), np.float32) if mask is None else self._check(mask, "mask", Bp, Tp, np.float32)
        msum = float(mask.sum(dtype=np.float64))
        if msum <= 0:
            raise ClgptError("mask has no nonzero entry; the loss would be 0/0")
        live = mask != 0
        if live.any() and (targets[live].min() < 0 or targets[live].max() >= V):
            raise ClgptError(f"target ids where mask != 0 must lie in [0, {V})")
        self._targets_host, self._mask_host = targets, mask
        cl.enqueue_copy(q, self.targets, targets, is_blocking=False)
        cl.enqueue_copy(q, self.mask, mask, is_blocking=False)
        self.ops.xent_forward(N, self.logits, self.targets, self.mask, self.losses, self.lse, self.dlogits,
                              smoothed=smoothed)
        losses = self.losses_host[:N]
        cl.enqueue_copy(q, losses, self.losses, is_blocking=True)
        self._fwd = (Bp, Tp, msum, self._drop, smoothed)
        return float(losses.sum(dtype=np.float64) / msum)

    def _w_out(self):
        return self.p["token_embd.weight"] if self.cfg.tied else self.p["output.weight"]

    def _g_out(self):
        return self.g["token_embd.weight"] if self.cfg.tied else self.g["output.weight"]

    def backward(self, scale: float = 1.0):
        """Accumulate scale * dloss/dparams of the last forward (with targets) into the grads."""
        if self._fwd is None:
            raise ClgptError("backward() needs a forward() with targets first")
        cfg = self.cfg
        Bp, Tp, msum, self._drop, smoothed = self._fwd
        N, C, V = Bp * Tp, cfg.n_embd, cfg.vocab_size
        # the head: dlogits = scale/sum(mask) * mask * (softmax - target distribution) (alpha carries the factor
        # where the fused forward left it unscaled), then the output projection's two products
        with self.ops.reuse(self.dlogits):
            alpha = self.ops.xent_backward(N, scale / msum, self.logits, self.targets, self.mask, self.lse,
                                           self.dlogits, smoothed=smoothed)
            self.ops.matmul(V, C, N, self.dlogits, self.lnf, self._g_out(), ta=1, accum=True, alpha=alpha)
            self.ops.matmul(N, C, V, self.dlogits, self._w_out(), self.dln, alpha=alpha)
        self._backward_body(Bp, Tp, scale)

    def _layer_done(self, i: int):
        if self.grad_hook is not None:
            self.grad_hook(i)

    def _token_embd_backward(self, N, dx):
        """dwte += dx rows by token: distinct tokens and their rows, sorted on the host (which holds the
        tokens), so each dwte row sums in a fixed order: deterministic, no float atomics."""
        tok = self._tokens_host.reshape(-1)
        order = np.argsort(tok, kind="stable").astype(np.int32)
        rows, starts = np.unique(tok[order], return_index=True)
        starts = np.append(starts, N).astype(np.int32)
        self._emb_host = (order, rows.astype(np.int32), starts)  # alive during the non-blocking copies
        for buf, arr in zip((self.emb_order, self.emb_rows, self.emb_starts), self._emb_host):
            cl.enqueue_copy(self.queue, buf, arr, is_blocking=False)
        self.ops.token_embd_backward(len(rows), self.emb_rows, self.emb_starts, self.emb_order, dx,
                                     self.g["token_embd.weight"])

    # ---- dropout sites (clgpt/models/dropout.py) ----
    def _dropped(self, layer: int, kind: str):
        """(seed, site id, p) when this forward drops out at (layer, kind), else None."""
        if self._drop is None:
            return None
        from clgpt.models.dropout import site

        return self._drop[0], site(layer, kind), self._drop[1]

    def _branch_grad(self, N, C, i, kind):
        """The gradient reaching a residual branch's output: dx, or dx through the branch's dropout."""
        if not self._drop:
            return self.dx
        self.ops.dropout_backward(N * C, *self._dropped(i, kind), self.dx, self.dres)
        return self.dres

    def _residual(self, n, layer, kind, resid, y, out):
        """out = resid + dropout(y) (n floats): the branch kept in y for the backward's mask."""
        s, site_id, p = self._dropped(layer, kind)
        self.ops.dropout_residual(n, s, site_id, p, resid, y, out)

    # ---- optimizer and host access: the parameter store ----
    def zero_grad(self):
        self.store.zero_grad()

    def grad_norm(self) -> float:
        return self.store.grad_norm()

    def step(self, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, muon: dict | None = None) -> float:
        """Clip grads to global norm `clip` (clip <= 0: no clipping), one AdamW step (an engine made with muon:
        Muon for the block matrices, `muon` its settings with lr scheduled); -> pre-clip norm."""
        return self.store.step(lr, beta1, beta2, eps, weight_decay, clip, muon)

    @property
    def t(self) -> int:
        return self.store.t

    def get_params(self) -> dict[str, np.ndarray]:
        return self.store.get_params()

    def set_params(self, d: dict):
        self.store.set_params(d)

    def get_grads(self) -> dict[str, np.ndarray]:
        return self.store.get_grads()

    def get_grads_flat(self) -> np.ndarray:
        return self.store.get_grads_flat()

    def set_grads_flat(self, a):
        self.store.set_grads_flat(a)

    def read_grads_async(self, names, host):
        return self.store.read_grads_async(names, host)

    def get_optimizer_state(self) -> dict:
        return self.store.get_optimizer_state()

    def set_optimizer_state(self, s: dict | None):
        self.store.set_optimizer_state(s)

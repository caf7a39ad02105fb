"""The LoRA training engine: adapters on a frozen base engine (clgpt/models/lora.py holds the adapters' shapes, the
merge and their GGUF export; it stays free of the device code, so the export stage does not re-run for a kernel
change)."""

from __future__ import annotations

import numpy as np

from clgpt.models.lora import (
    A_SUFFIX,
    B_SUFFIX,
    LoraSpec,
    adapter_shapes,
    init_adapters,
    target_shapes,
)


class LoraEngine:
    """The engine interface the training loop drives (forward, backward, zero_grad, step, get/set state),
    over a base engine made with optimizer=False: adapters train, the base stays W0 (module docstring)."""

    def __init__(self, base, spec: LoraSpec, seed: int, adapters: dict | None = None):
        from clgpt.models.params import ParamStore

        self.base, self.spec, self.cfg = base, spec, base.cfg
        self.ops, self.queue = base.ops, base.queue
        self.targets = target_shapes(base.cfg, spec.targets)
        self.store = ParamStore(self.ops, adapter_shapes(base.cfg, spec), decays=lambda name: False)
        self.p, self.g = self.store.p, self.store.g
        w0 = base.get_params()
        self.w0 = {n: self._upload(w0[n]) for n in self.targets}  # the frozen base of each target (out, in)
        self.scratch = self.ops.buf(max(o * i for o, i in self.targets.values()))
        self._dirty = True
        self.set_adapters(adapters if adapters is not None else init_adapters(base.cfg, spec, seed))
        self.store.set_optimizer_state(None)
        self.zero_grad()

    def _upload(self, a: np.ndarray):
        import pyopencl as cl

        buf = self.ops.buf(a.size)
        cl.enqueue_copy(self.queue, buf, np.ascontiguousarray(a, np.float32), is_blocking=True)
        return buf

    # ---- the merged weights and the adapters' gradients, on the device ----
    def _merge(self):
        """W = W0 + s * B @ A into the base's parameter store, for every target."""
        import pyopencl as cl

        if not self._dirty:
            return
        r, s, store = self.spec.rank, self.spec.scale, self.base.store
        for name, (o, i) in self.targets.items():
            self.ops.matmul(o, i, r, self.p[name + B_SUFFIX], self.p[name + A_SUFFIX], self.scratch,
                            resid=self.w0[name], alpha=s)
            cl.enqueue_copy(self.queue, store.flat_p, self.scratch, byte_count=o * i * 4,
                            dst_offset=store.offsets[name] * 4)
        self._dirty = False

    def _adapter_grads(self):
        """dA = s * B.T @ dW (r, in), dB = s * dW @ A.T (out, r) from the base's accumulated dW."""
        import pyopencl as cl

        r, s, store = self.spec.rank, self.spec.scale, self.base.store
        for name, (o, i) in self.targets.items():
            cl.enqueue_copy(self.queue, self.scratch, store.flat_g, byte_count=o * i * 4,
                            src_offset=store.offsets[name] * 4)
            self.ops.matmul(r, i, o, self.p[name + B_SUFFIX], self.scratch, self.g[name + A_SUFFIX], ta=1, alpha=s)
            self.ops.matmul(o, r, i, self.scratch, self.p[name + A_SUFFIX], self.g[name + B_SUFFIX], tb=1, alpha=s)

    # ---- what the training loop calls ----
    def forward(self, tokens, targets=None, mask=None, dropout_seed=None, smoothed=True):
        self._merge()
        return self.base.forward(tokens, targets, mask, dropout_seed=dropout_seed, smoothed=smoothed)

    def next_logits(self, tokens, last):
        self._merge()
        return self.base.next_logits(tokens, last)

    def backward(self, scale: float = 1.0):
        self.base.backward(scale)

    def zero_grad(self):
        self.base.zero_grad()
        self.store.zero_grad()

    def grad_norm(self) -> float:
        self._adapter_grads()
        return self.store.grad_norm()

    def step(self, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, muon: dict | None = None) -> float:
        """AdamW on the adapters only (weight decay off: it would pull the update, not the weights, to zero);
        `muon` is ignored: adapters keep AdamW."""
        self._adapter_grads()
        norm = self.store.step(lr, beta1, beta2, eps, 0.0, clip)
        self._dirty = True
        return norm

    @property
    def t(self) -> int:
        return self.store.t

    def get_grads(self) -> dict[str, np.ndarray]:
        """The adapters' gradients of the last backward(s)."""
        self._adapter_grads()
        return self.store.get_grads()

    def get_adapters(self) -> dict[str, np.ndarray]:
        return self.store.get_params()

    def set_adapters(self, d: dict):
        self.store.set_params(d)
        self._dirty = True

    def get_params(self) -> dict[str, np.ndarray]:
        """The merged weights: the tuned model."""
        self._merge()
        return self.base.get_params()

    def set_params(self, d: dict):
        """Not read back: the merged weights follow from the frozen base and the adapters, which
        set_optimizer_state restores (a checkpoint's params are merged ones)."""

    def get_optimizer_state(self) -> dict:
        state = self.store.get_optimizer_state()
        state["lora"] = {**self.spec.to_dict(), "adapters": self.get_adapters()}
        return state

    def set_optimizer_state(self, s: dict | None):
        if s is not None and "lora" in s:
            self.set_adapters(s["lora"]["adapters"])
        self.store.set_optimizer_state(None if s is None else {k: s[k] for k in ("m", "v", "t")})


# ---- the adapter GGUF ---------------------------------------------------------------------------

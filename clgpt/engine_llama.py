"""LlamaEngine: the llama forward and backward (dense SwiGLU or mixture of experts) on an OpenCL device.

Subclasses `clgpt.engine.Engine` and keeps its public API; the flat parameter / gradient / AdamW buffers,
`matmul`, `_run`, `zero_grad`, `grad_norm`, `step` and the host access are Engine's. What differs:

    x = token_embd[tokens]                                      (no position table: RoPE in attention)
    for each block:  x = x + attn_output(attn(rope(q), rope(k), v))  with q, k, v = attn_{q,k,v}(rms(x))
                     x = x + ffn(rms(x, ffn_norm))
    ffn = ffn_down(silu(ffn_gate(h)) * ffn_up(h))               dense, or for n_expert > 0:
    ffn = sum_k w_k expert_{sel_k}(h),  sel = top-k of softmax(ffn_gate_inp(h)),  w = renormalised probs
    logits = rms(x, output_norm) @ (output.weight or token_embd.weight).T

Shapes: B batch, T time, N = B*T rows, C n_embd, H heads, Hkv kv heads, D = C // H, F n_ff, E experts,
K experts used, S rows reserved per expert (>= B*T, a multiple of the device's sub-buffer alignment).

Attention reuses kernels/attention.cl: rope.cl rotates q and k and packs q | k | v into its (N,3C) qkv
layout, repeating each kv head for its H/Hkv query heads (grouped-query attention).

Mixture of experts, k of n, deterministic: the router kernel picks each token's top-k; one work-item per
expert lists its tokens in increasing order; the host reads the E counts back (one small blocking read per
layer and forward) and runs each expert's three matmuls on only its rows, gathered into expert e's block
of S rows; a combine kernel sums the k weighted outputs per token in order. Expert matrices are slices of
a stacked (E, F, C) tensor whose origins are not sub-buffer aligned, so the forward copies them into
aligned staging buffers (once per parameter update) and the backward adds each expert's weight gradient
into its slice with a small kernel. The load-balancing loss `cfg.moe_aux_loss * E * sum_e f_e P_e` (per
layer, f_e = share of the N*K assignments on expert e, P_e = mean router probability, over all B'*T' rows)
enters the backward only: `forward` returns the cross-entropy alone, `aux_loss()` the last forward's aux.

`expert_usage()` -> (L, E): the fraction of the last forward's tokens that routed to each expert.
`freeze_routing(True)` reuses the last forward's top-k indices (gradient checks: routing is discrete).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from clgpt.device import Device
from clgpt.engine import Engine, _ceil
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig

F32 = 4
i32, f32 = np.int32, np.float32
_EXPERT_MATS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def make_engine(cfg: ModelConfig, params: dict, batch_size: int, seq_len: int, device: Device | None = None,
                precision: str = "fp32") -> Engine:
    """The engine for cfg.arch: Engine (gpt2) or LlamaEngine (llama), same public API; precision: the
    matmuls' (clgpt/precision.py)."""
    cls = LlamaEngine if cfg.arch == "llama" else Engine
    return cls(cfg, params, batch_size=batch_size, seq_len=seq_len, device=device, precision=precision)


class LlamaEngine(Engine):
    def __init__(self, cfg: ModelConfig, params: dict, batch_size: int, seq_len: int, device: Device | None = None,
                 precision: str = "fp32"):
        if cfg.arch != "llama":
            raise ClgptError(f"LlamaEngine runs arch 'llama', not {cfg.arch!r}; use clgpt.engine_llama.make_engine")
        self._staged = False
        self._fixed_routing = False
        super().__init__(cfg, params, batch_size, seq_len, device, precision)

    # ---- kernels and buffers ----
    def _build_kernels(self):
        super()._build_kernels()
        cfg, dev, k = self.cfg, self.dev, self.k
        C, D, E = cfg.n_embd, cfg.head_dim, cfg.n_expert
        for kname in ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_param_backward"):
            k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps))
        for kname in ("rope_qkv_forward", "rope_qkv_backward"):
            k[kname] = dev.kernel("rope", kname, C=C, D=D, G=cfg.n_head // cfg.kv_heads, CKV=cfg.kv_heads * D)
        for kname in ("swiglu_forward", "swiglu_backward"):
            k[kname] = dev.kernel("swiglu", kname)
        # the Engine kernels used here, fetched under their own names (cached per device + options)
        k["embedding_forward"] = dev.kernel("embedding", "embedding_forward", C=C)
        k["embedding_backward_wte"] = dev.kernel("embedding", "embedding_backward_wte", C=C)
        for kname in ("attention_forward", "attention_backward_query", "attention_backward_key"):
            k[kname] = dev.kernel("attention", kname, C=C, H=cfg.n_head, D=D, SCALE=float(1.0 / np.sqrt(D)))
        for kname in ("xent_forward", "xent_backward"):
            k[kname] = dev.kernel("xent", kname, V=cfg.vocab_size)
        if E:
            self.align = max(64, self.dev.device.mem_base_addr_align // 8 // F32)  # in floats
            self.S = _ceil(self.B * self.T, self.align)
            for kname in ("moe_router_forward", "moe_route", "moe_gather", "moe_combine_forward",
                          "moe_combine_backward", "moe_weight_backward", "moe_router_backward",
                          "moe_scatter_backward", "moe_accumulate"):
                k[kname] = dev.kernel("moe", kname, E=E, K=cfg.n_expert_used, C=C, S=self.S)

    def _alloc(self):
        super()._alloc()  # flat parameter / gradient / optimizer buffers (and GPT-2 activations, dropped below)
        cfg, B, T = self.cfg, self.B, self.T
        N, C, V, F, H, L = B * T, cfg.n_embd, cfg.vocab_size, cfg.n_ff, cfg.n_head, cfg.n_layer
        Ckv, E, K = cfg.kv_heads * cfg.head_dim, cfg.n_expert, cfg.n_expert_used
        ib = lambda n: cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(1, n) * 4)  # noqa: E731
        # the GPT-2 activations of Engine._alloc are replaced (same names) or dropped here
        self.lnf_mean = self.lnf_rstd = self.dg = self.dh = None
        self.tokens, self.targets, self.mask = ib(N), ib(N), self._buf(N)
        self.emb_order, self.emb_rows, self.emb_starts = ib(N), ib(N), ib(N + 1)
        self.zero_pos = self._buf(T * C)  # embedding_forward adds a position row: zeros here
        cl.enqueue_fill_buffer(self.queue, self.zero_pos, np.float32(0), 0, T * C * F32)
        cos, sin = _rope_tables(T, cfg.head_dim, cfg.rope_base)
        mf = cl.mem_flags
        self.rope_cos = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=cos)
        self.rope_sin = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=sin)
        self.acts = []
        for _ in range(L):
            a = dict(x=self._buf(N * C), ln1=self._buf(N * C), r1=self._buf(N), qkv=self._buf(N * 3 * C),
                     att=self._buf(B * H * T * T), atty=self._buf(N * C), x_mid=self._buf(N * C),
                     ln2=self._buf(N * C), r2=self._buf(N))
            if E:
                S = self.S
                a.update(probs=self._buf(N * E), sel=ib(N * K), w=self._buf(N * K), lists=ib(E * S),
                         pos=ib(N * K), counts=ib(E), pmean=self._buf(E), xg=self._buf(E * S * C),
                         hg=self._buf(E * S * F), hu=self._buf(E * S * F), act=self._buf(E * S * F),
                         ye=self._buf(E * S * C))
                for key, width in (("xg", C), ("hg", F), ("hu", F), ("act", F), ("ye", C)):
                    a[key + "_e"] = [a[key].get_sub_region(e * S * width * F32, S * width * F32) for e in range(E)]
            else:
                a.update(hg=self._buf(N * F), hu=self._buf(N * F), act=self._buf(N * F))
            self.acts.append(a)
        self.x_out, self.lnf, self.rf = self._buf(N * C), self._buf(N * C), self._buf(N)
        self.logits, self.losses, self.lse = self._buf(N * V), self._buf(N), self._buf(N)
        # backward scratch, reused by every layer
        self.dlogits, self.dx, self.dln = self._buf(N * V), self._buf(N * C), self._buf(N * C)
        self.datty, self.dqkv, self.datt = self._buf(N * C), self._buf(N * 3 * C), self._buf(B * H * T * T)
        self.q, self.kk, self.v = self._buf(N * C), self._buf(N * Ckv), self._buf(N * Ckv)
        self.dq, self.dk, self.dv = self._buf(N * C), self._buf(N * Ckv), self._buf(N * Ckv)
        if not E:
            self.dact, self.dhg, self.dhu = self._buf(N * F), self._buf(N * F), self._buf(N * F)
        if E:
            S, FC = self.S, F * C
            self.stride_w = _ceil(FC, self.align)
            # aligned copies of every expert matrix: stage[(layer, name)][e] (F,C) or (C,F)
            self.stage = {}
            for i in range(L):
                for name in _EXPERT_MATS:
                    buf = self._buf(E * self.stride_w)
                    self.stage[(i, name)] = [buf.get_sub_region(e * self.stride_w * F32, FC * F32) for e in range(E)]
            self.gstage = self._buf(FC)
            self.rlogits, self.drlogits, self.dwsel = self._buf(N * E), self._buf(N * E), self._buf(N * K)
            self.dye, self.dxg = self._buf(E * S * C), self._buf(E * S * C)
            self.dact, self.dhg, self.dhu = self._buf(E * S * F), self._buf(E * S * F), self._buf(E * S * F)
            self.dye_e = [self.dye.get_sub_region(e * S * C * F32, S * C * F32) for e in range(E)]
            self.dxg_e = [self.dxg.get_sub_region(e * S * C * F32, S * C * F32) for e in range(E)]
            self.dact_e, self.dhg_e, self.dhu_e = (
                [b.get_sub_region(e * S * F * F32, S * F * F32) for e in range(E)] for b in (self.dact, self.dhg, self.dhu))
        self.losses_host = np.empty(N, np.float32)
        self._counts = np.zeros((L, max(E, 1)), np.int32)
        self._pmean = np.zeros((L, max(E, 1)), np.float32)
        self._n_routed = 0

    # ---- parameters change: restage the expert matrices before the next forward ----
    def set_params(self, d: dict):
        super().set_params(d)
        self._staged = False

    def step(self, *args, **kwargs) -> float:
        self._staged = False
        return super().step(*args, **kwargs)

    def _stage_experts(self):
        cfg = self.cfg
        nbytes = cfg.n_ff * cfg.n_embd * F32
        for i in range(cfg.n_layer):
            for name in _EXPERT_MATS:
                src = self.p[f"blk.{i}.{name}.weight"]
                for e, dst in enumerate(self.stage[(i, name)]):
                    cl.enqueue_copy(self.queue, dst, src, byte_count=nbytes, src_offset=e * nbytes, dst_offset=0)
        self._staged = True

    def freeze_routing(self, on: bool = True):
        """Reuse the last forward's top-k indices in later forwards (same B', T'): gradient checks."""
        self._fixed_routing = bool(on)

    def expert_usage(self) -> np.ndarray:
        """(L, E) fraction of the last forward's B'*T' tokens routed to each expert (rows sum to K)."""
        if not self.cfg.n_expert:
            raise ClgptError("expert_usage: this model has no experts (model.n_expert is 0)")
        if not self._n_routed:
            raise ClgptError("expert_usage: run forward() first")
        return self._counts.astype(np.float64) / self._n_routed

    def aux_loss(self) -> float:
        """The last forward's load-balancing loss, sum over layers of E * sum_e f_e P_e (0 when dense)."""
        cfg = self.cfg
        if not cfg.n_expert or not self._n_routed:
            return 0.0
        f = self._counts.astype(np.float64) / (self._n_routed * cfg.n_expert_used)
        return float(cfg.n_expert * (f * self._pmean.astype(np.float64)).sum())

    # ---- forward ----
    def _rmsnorm(self, N, x, w, out, rstd):
        self._run("rmsnorm_forward", (N,), i32(N), x, w, out, rstd)

    def _rmsnorm_backward(self, N, dout, x, rstd, w, dw, dx, accum):
        self._run("rmsnorm_backward", (N,), i32(N), i32(accum), dout, x, w, rstd, dx)
        self._run("rmsnorm_param_backward", (self.cfg.n_embd,), i32(N), dout, x, rstd, dw)

    def forward(self, tokens, targets=None, mask=None):
        """Mean masked NLL (float) when targets are given, else logits (B', T', V) float32."""
        cfg, q = self.cfg, self.queue
        tokens = self._check_tokens(tokens)
        Bp, Tp = tokens.shape
        N, C, V, F = Bp * Tp, cfg.n_embd, cfg.vocab_size, cfg.n_ff
        Ckv = cfg.kv_heads * cfg.head_dim
        if cfg.n_expert and self._fixed_routing and self._n_routed != N:
            raise ClgptError("freeze_routing: the routing was recorded for another batch shape")
        if cfg.n_expert and not self._staged:
            self._stage_experts()
        cl.enqueue_copy(q, self.tokens, tokens, is_blocking=False)
        self._tokens_host = tokens
        self._run("embedding_forward", (C, N), i32(N), i32(Tp), self.tokens, self.p["token_embd.weight"],
                  self.zero_pos, self.acts[0]["x"] if cfg.n_layer else self.x_out)
        for i, a in enumerate(self.acts):
            pre, p = f"blk.{i}.", self.p
            x_next = self.acts[i + 1]["x"] if i + 1 < cfg.n_layer else self.x_out
            self._rmsnorm(N, a["x"], p[pre + "attn_norm.weight"], a["ln1"], a["r1"])
            self.matmul(N, C, C, a["ln1"], p[pre + "attn_q.weight"], self.q, tb=1)
            self.matmul(N, Ckv, C, a["ln1"], p[pre + "attn_k.weight"], self.kk, tb=1)
            self.matmul(N, Ckv, C, a["ln1"], p[pre + "attn_v.weight"], self.v, tb=1)
            self._run("rope_qkv_forward", (3 * (C // 2), N), i32(N), i32(Tp), self.q, self.kk, self.v,
                      self.rope_cos, self.rope_sin, a["qkv"])
            self._run("attention_forward", (Tp, Bp * cfg.n_head), i32(Bp), i32(Tp), a["qkv"], a["atty"], a["att"])
            self.matmul(N, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], tb=1, resid=a["x"])
            self._rmsnorm(N, a["x_mid"], p[pre + "ffn_norm.weight"], a["ln2"], a["r2"])
            if cfg.n_expert:
                self._moe_forward(i, a, N, x_next)
            else:
                self.matmul(N, F, C, a["ln2"], p[pre + "ffn_gate.weight"], a["hg"], tb=1)
                self.matmul(N, F, C, a["ln2"], p[pre + "ffn_up.weight"], a["hu"], tb=1)
                self._run("swiglu_forward", (_ceil(N * F, 256),), i32(N * F), a["hg"], a["hu"], a["act"], lsize=(256,))
                self.matmul(N, C, F, a["act"], p[pre + "ffn_down.weight"], x_next, tb=1, resid=a["x_mid"])
        self._rmsnorm(N, self.x_out, self.p["output_norm.weight"], self.lnf, self.rf)
        self.matmul(N, V, C, self.lnf, self._w_out(), self.logits, tb=1)
        return self._loss(Bp, Tp, targets, mask, self._xent_plain)

    def _xent_plain(self, N):
        # the unfused kernels: backward reads lse (the GPT-2 engine's CPU path fuses the gradient instead)
        self._run("xent_forward", (N,), i32(N), self.logits, self.targets, self.mask, self.losses, self.lse)

    def _moe_forward(self, i, a, N, x_next):
        cfg, pre = self.cfg, f"blk.{i}."
        C, F, E, S = cfg.n_embd, cfg.n_ff, cfg.n_expert, self.S
        self.matmul(N, E, C, a["ln2"], self.p[pre + "ffn_gate_inp.weight"], self.rlogits, tb=1)
        self._run("moe_router_forward", (N,), i32(N), i32(self._fixed_routing), self.rlogits, a["probs"], a["sel"], a["w"])
        self._run("moe_route", (E,), i32(N), a["probs"], a["sel"], a["lists"], a["pos"], a["counts"], a["pmean"])
        cl.enqueue_copy(self.queue, self._counts[i], a["counts"], is_blocking=False)
        cl.enqueue_copy(self.queue, self._pmean[i], a["pmean"], is_blocking=True)
        self._n_routed = N
        self._run("moe_gather", (C, E * S), a["counts"], a["lists"], a["ln2"], a["xg"])
        sg, su, sd = (self.stage[(i, name)] for name in _EXPERT_MATS)
        for e, m in enumerate(int(c) for c in self._counts[i]):
            if m == 0:
                continue
            self.matmul(m, F, C, a["xg_e"][e], sg[e], a["hg_e"][e], tb=1)
            self.matmul(m, F, C, a["xg_e"][e], su[e], a["hu_e"][e], tb=1)
            self._run("swiglu_forward", (_ceil(m * F, 256),), i32(m * F), a["hg_e"][e], a["hu_e"][e], a["act_e"][e],
                      lsize=(256,))
            self.matmul(m, C, F, a["act_e"][e], sd[e], a["ye_e"][e], tb=1)
        self._run("moe_combine_forward", (C, N), i32(N), a["x_mid"], a["w"], a["pos"], a["ye"], x_next)

    # ---- backward ----
    def backward(self, scale: float = 1.0):
        """Accumulate scale * d(loss + moe_aux_loss * aux)/dparams of the last forward (with targets)."""
        if self._fwd is None:
            raise ClgptError("backward() needs a forward() with targets first")
        cfg = self.cfg
        Bp, Tp, msum = self._fwd
        N, C, V, F, H = Bp * Tp, cfg.n_embd, cfg.vocab_size, cfg.n_ff, cfg.n_head
        Ckv = cfg.kv_heads * cfg.head_dim
        p, g, dx, dln = self.p, self.g, self.dx, self.dln
        self._run("xent_backward", (_ceil(V, 64), N), i32(N), f32(scale / msum), self.logits, self.targets,
                  self.mask, self.lse, self.dlogits, lsize=(64, 1))
        g_out = g["token_embd.weight"] if cfg.tied else g["output.weight"]
        self.matmul(V, C, N, self.dlogits, self.lnf, g_out, ta=1, accum=True)
        self.matmul(N, C, V, self.dlogits, self._w_out(), dln)
        self._rmsnorm_backward(N, dln, self.x_out, self.rf, p["output_norm.weight"], g["output_norm.weight"], dx, 0)
        for i in reversed(range(cfg.n_layer)):
            pre, a = f"blk.{i}.", self.acts[i]
            if cfg.n_expert:
                self._moe_backward(i, a, N, scale)
            else:  # x_out = x_mid + act @ Wdown.T, act = silu(ln2 @ Wgate.T) * (ln2 @ Wup.T)
                self.matmul(C, F, N, dx, a["act"], g[pre + "ffn_down.weight"], ta=1, accum=True)
                self.matmul(N, F, C, dx, p[pre + "ffn_down.weight"], self.dact)
                self._run("swiglu_backward", (_ceil(N * F, 256),), i32(N * F), self.dact, a["hg"], a["hu"],
                          self.dhg, self.dhu, lsize=(256,))
                self.matmul(F, C, N, self.dhg, a["ln2"], g[pre + "ffn_gate.weight"], ta=1, accum=True)
                self.matmul(F, C, N, self.dhu, a["ln2"], g[pre + "ffn_up.weight"], ta=1, accum=True)
                self.matmul(N, C, F, self.dhg, p[pre + "ffn_gate.weight"], dln)
                self.matmul(N, C, F, self.dhu, p[pre + "ffn_up.weight"], dln, accum=True)
            self._rmsnorm_backward(N, dln, a["x_mid"], a["r2"], p[pre + "ffn_norm.weight"], g[pre + "ffn_norm.weight"],
                                   dx, 1)
            # attention: x_mid = x + atty @ Wo.T
            self.matmul(C, C, N, dx, a["atty"], g[pre + "attn_output.weight"], ta=1, accum=True)
            self.matmul(N, C, C, dx, p[pre + "attn_output.weight"], self.datty)
            self._run("attention_backward_query", (Tp, Bp * H), i32(Bp), i32(Tp), self.datty, a["qkv"], a["att"],
                      self.datt, self.dqkv)
            self._run("attention_backward_key", (Tp, Bp * H), i32(Bp), i32(Tp), self.datty, a["qkv"], a["att"],
                      self.datt, self.dqkv)
            self._run("rope_qkv_backward", (C // 2 + Ckv, N), i32(N), i32(Tp), self.dqkv, self.rope_cos,
                      self.rope_sin, self.dq, self.dk, self.dv)
            for j, (d, width) in enumerate(((self.dq, C), (self.dk, Ckv), (self.dv, Ckv))):
                name = pre + f"attn_{'qkv'[j]}.weight"
                self.matmul(width, C, N, d, a["ln1"], g[name], ta=1, accum=True)
                self.matmul(N, C, width, d, p[name], dln, accum=j > 0)
            self._rmsnorm_backward(N, dln, a["x"], a["r1"], p[pre + "attn_norm.weight"], g[pre + "attn_norm.weight"],
                                   dx, 1)
        self._token_embd_backward(N, dx)

    def _moe_backward(self, i, a, N, scale):
        cfg, pre, p, g = self.cfg, f"blk.{i}.", self.p, self.g
        C, F, E, K = cfg.n_embd, cfg.n_ff, cfg.n_expert, cfg.n_expert_used
        dx, dln = self.dx, self.dln
        self._run("moe_combine_backward", (C, N * K), i32(N), dx, a["w"], a["pos"], self.dye)
        self._run("moe_weight_backward", (N * K,), i32(N), dx, a["pos"], a["ye"], self.dwsel)
        sg, su, sd = (self.stage[(i, name)] for name in _EXPERT_MATS)
        gnames = [g[f"{pre}{name}.weight"] for name in _EXPERT_MATS]
        FC = F * C

        def grad_into(M, Nn, Kk, A, B, gbuf, e):  # g[e] += A.T @ B, through the aligned staging buffer
            self.matmul(M, Nn, Kk, A, B, self.gstage, ta=1)
            self._run("moe_accumulate", (_ceil(FC, 256),), i32(FC), i32(e * FC), self.gstage, gbuf, lsize=(256,))

        for e, m in enumerate(int(c) for c in self._counts[i]):
            if m == 0:
                continue
            grad_into(C, F, m, self.dye_e[e], a["act_e"][e], gnames[2], e)
            self.matmul(m, F, C, self.dye_e[e], sd[e], self.dact_e[e])
            self._run("swiglu_backward", (_ceil(m * F, 256),), i32(m * F), self.dact_e[e], a["hg_e"][e], a["hu_e"][e],
                      self.dhg_e[e], self.dhu_e[e], lsize=(256,))
            grad_into(F, C, m, self.dhg_e[e], a["xg_e"][e], gnames[0], e)
            grad_into(F, C, m, self.dhu_e[e], a["xg_e"][e], gnames[1], e)
            self.matmul(m, C, F, self.dhg_e[e], sg[e], self.dxg_e[e])
            self.matmul(m, C, F, self.dhu_e[e], su[e], self.dxg_e[e], accum=True)
        aux_scale = scale * cfg.moe_aux_loss * E / (float(N) * N * K)
        self._run("moe_router_backward", (N,), i32(N), f32(aux_scale), self.dwsel, a["probs"], a["sel"], a["w"],
                  a["counts"], self.drlogits)
        self.matmul(E, C, N, self.drlogits, a["ln2"], g[pre + "ffn_gate_inp.weight"], ta=1, accum=True)
        self.matmul(N, C, E, self.drlogits, p[pre + "ffn_gate_inp.weight"], dln)
        self._run("moe_scatter_backward", (C, N), i32(N), a["pos"], self.dxg, dln)


def _rope_tables(T: int, D: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (T, D/2) float32 of t * base^(-2i/D), computed in float64."""
    theta = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * theta[None]
    return np.ascontiguousarray(np.cos(ang), np.float32), np.ascontiguousarray(np.sin(ang), np.float32)

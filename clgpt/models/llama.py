"""LlamaEngine: the llama forward and backward (dense SwiGLU or mixture of experts), written against the
launchers of clgpt.ops, so llama takes every device path gpt2 takes (CPU row-blocked attention, GPU batched
attention and row kernels, fused cross-entropy, preset launches).

    x = drop(token_embd[tokens])                                 (no position table: RoPE in attention)
    for each block:  x = x + drop(attn_output(attn(rope(q), rope(k), v)))  q, k, v = attn_{q,k,v}(rms(x))
                     x = x + drop(ffn(rms(x, ffn_norm)))
    ffn = ffn_down(silu(ffn_gate(h)) * ffn_up(h))               dense, or for n_expert > 0:
    ffn = sum_k w_k expert_{sel_k}(h),  sel = top-k of softmax(ffn_gate_inp(h)),  w = renormalised probs
    logits = rms(x, output_norm) @ (output.weight or token_embd.weight).T      (head: clgpt.models.base)

Shapes: B batch, T time, N = B*T rows, C n_embd, H heads, Hkv kv heads, D = C // H, F n_ff, E experts,
K experts used, R = N*K + E*(RM-1) rows of the packed expert operands, up to a multiple of 64 and of the
sub-buffer alignment (RM: the row alignment of the grouped products, Ops.grouped_tiles).

The parameter store lays attn_q | attn_k | attn_v back to back (and, dense, ffn_gate | ffn_up), so each is
one product: (N, C + 2 Ckv) = h @ [Wq; Wk; Wv].T, (N, 2F) = h @ [Wg; Wu].T, and one weight-gradient and one
input-gradient product each in the backward. Attention runs kernels/attention.cl: rope.cl rotates q and k
of the product's output into its (N,3C) qkv layout, repeating each kv head for its H/Hkv query heads
(grouped-query attention); without grouping the layouts agree and RoPE runs in place. The model hands RoPE
to the attention launchers with the call (rope=), which decide where it runs (clgpt/ops/attention.py).
swiglu.cl's row kernel reads gate | up rows; the backward's dgate | dup is the epilogue of the dact = dy @ Wdown
product.

Mixture of experts as grouped work, deterministic, all on the device (clgpt/ops/grouped.py): the router kernel
picks each token's top-k; the routing packs each expert's tokens in increasing order at a tile-aligned offset;
a gather copies the rows there; the experts' products are grouped launches over all experts (a tile of rows
finds its expert, whose matrix is a slice of the stacked (E, F, C) tensor; weight gradients sum each expert's
rows in order straight into its slice; where the launchers can, gate and up are one product, as in the dense
block); a combine kernel
sums the k weighted outputs per token in order. Nothing comes back to the host within a step (the expert
counts and mean probabilities are read only when expert_usage or aux_loss ask). The load-balancing loss `cfg.moe_aux_loss * E * sum_e f_e P_e` (per
layer, f_e = share of the N*K assignments on expert e, P_e = mean router probability, over all B'*T' rows)
enters the backward only: `forward` returns the cross-entropy alone, `aux_loss()` the last forward's aux.

`expert_usage()` -> (L, E): the fraction of the last forward's tokens that routed to each expert.
`freeze_routing(True)` keeps the last forward's top-k indices (gradient checks: routing is discrete).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from clgpt.errors import ClgptError
from clgpt.models.base import EngineBase
from clgpt.ops import F32, ceil_to

i32 = np.int32
_EXPERT_MATS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class LlamaEngine(EngineBase):
    arch = "llama"
    saved = ("ln1", "atty", "ln2", "act", "xg")  # the products' inputs the backward reads again

    def __init__(self, *args, **kwargs):
        self._fixed_routing = False
        super().__init__(*args, **kwargs)

    # ---- kernels and buffers ----
    def _packed(self):
        views = {}
        for i in range(self.cfg.n_layer):
            pre = f"blk.{i}."
            views[pre + "attn_q+k+v"] = tuple(pre + f"attn_{x}.weight" for x in "qkv")
            if not self.cfg.n_expert:
                views[pre + "ffn_gate+up"] = (pre + "ffn_gate.weight", pre + "ffn_up.weight")
        return views

    def _product_weights(self):
        cfg = self.cfg
        C, F, Ckv = cfg.n_embd, cfg.n_ff, cfg.kv_heads * cfg.head_dim
        block = [("attn_q+k+v", C + 2 * Ckv, C), ("attn_output.weight", C, C)]
        if cfg.n_expert:  # the router; the experts' grouped products make their own copies (clgpt/ops/grouped.py)
            block += [("ffn_gate_inp.weight", cfg.n_expert, C)]
        else:
            block += [("ffn_gate+up", 2 * F, C), ("ffn_down.weight", C, F)]
        return super()._product_weights() + [(f"blk.{i}.{name}", rows, cols) for i in range(cfg.n_layer)
                                             for name, rows, cols in block]

    def _alloc(self):
        self.ops.build_llama()
        cfg, B, T, buf = self.cfg, self.B, self.T, self.ops.buf
        N, C, F, H, L = B * T, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_layer
        Ckv, E, K = cfg.kv_heads * cfg.head_dim, cfg.n_expert, cfg.n_expert_used
        ib = lambda n: cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(1, n) * 4)  # noqa: E731
        self.zero_pos = buf(T * C)  # embedding_forward adds a position row: zeros here
        cl.enqueue_fill_buffer(self.queue, self.zero_pos, np.float32(0), 0, T * C * F32)
        cos, sin = _rope_tables(T, cfg.head_dim, cfg.rope_base)
        mf = cl.mem_flags
        self.rope_cos = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=cos)
        self.rope_sin = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=sin)
        if E:
            RM = self.ops.grouped_tiles()["RM"]
            # rows up to a multiple of 64: the tiled bf16 copies of the packed operands have no padding then
            # (and of the sub-buffer alignment: hgu's halves are views)
            self.R, self.max_tiles = ceil_to(N * K + E * (RM - 1), max(64, self.ops.align)), -(-N * K // RM) + E
        self.acts = []
        for _ in range(L):
            a = dict(x=buf(N * C), ln1=buf(N * C), r1=buf(N), qkv=buf(N * 3 * C), att=buf(self.ops.att_floats(B, T)),
                     atty=buf(N * C), x_mid=buf(N * C), ln2=buf(N * C), r2=buf(N))
            if self.dropout and not (self.ops.flash or self.ops.flash_portable):  # flash redraws the mask
                a["att_d"] = buf(B * H * T * T)
            if E:
                R = self.R
                a.update(probs=buf(N * E), sel=ib(N * K), w=buf(N * K), pos=ib(N * K), counts=ib(E), offs=ib(E),
                         tiles=ib(E + 1), pmean=buf(E), xg=buf(R * C), hgu=buf(R * 2 * F),
                         act=buf(R * F), ye=buf(R * C))
            else:
                a.update(hgu=buf(N * 2 * F), act=buf(N * F))  # gate | up, silu(gate) * up
            self.acts.append(a)
        self.rf = buf(N)
        # backward scratch, shared by every layer
        self.datty, self.dqkv, self.datt = buf(N * C), buf(N * 3 * C), buf(self.ops.att_floats(B, T))
        if Ckv != C:  # grouped: the q | k | v product's output and gradient apart from attention's layout
            self.hqkv, self.dhqkv = buf(N * (C + 2 * Ckv)), buf(N * (C + 2 * Ckv))
        if self.dropout:  # a residual branch before its dropout (forward), its gradient after (backward)
            self.branch, self.dres = buf(N * C), buf(N * C)
            if E:
                self.zero_res = buf(N * C)
                cl.enqueue_fill_buffer(self.queue, self.zero_res, np.float32(0), 0, N * C * F32)
        if not E:
            self.dhgu = buf(N * 2 * F)
        else:
            R = self.R
            self.rlogits, self.drlogits, self.dwsel = buf(N * E), buf(N * E), buf(N * K)
            self.dye, self.dxg = buf(R * C), buf(R * C)
            self.dact, self.dhgu = buf(R * F), buf(R * 2 * F)
        self._counts = np.zeros((L, max(E, 1)), np.int32)
        self._pmean = np.zeros((L, max(E, 1)), np.float32)
        self._n_routed = 0

    def freeze_routing(self, on: bool = True):
        """Keep the last forward's top-k indices for later forwards (same B', T'): gradient checks."""
        self._fixed_routing = bool(on)

    def expert_usage(self) -> np.ndarray:
        """(L, E) fraction of the last forward's B'*T' tokens routed to each expert (rows sum to K)."""
        if not self.cfg.n_expert:
            raise ClgptError("expert_usage: this model has no experts (model.n_expert is 0)")
        if not self._n_routed:
            raise ClgptError("expert_usage: run forward() first")
        self._read_routing()
        return self._counts.astype(np.float64) / self._n_routed

    def _read_routing(self):
        """The last forward's expert counts and mean router probabilities, per layer, from the device (read
        only when asked: a copy within the step would stall the queue on a GPU)."""
        for i, a in enumerate(self.acts):
            cl.enqueue_copy(self.queue, self._counts[i], a["counts"], is_blocking=False)
            cl.enqueue_copy(self.queue, self._pmean[i], a["pmean"], is_blocking=False)
        self.queue.finish()

    def aux_loss(self) -> float:
        """The last forward's load-balancing loss, sum over layers of E * sum_e f_e P_e (0 when dense)."""
        cfg = self.cfg
        if not cfg.n_expert or not self._n_routed:
            return 0.0
        self._read_routing()
        f = self._counts.astype(np.float64) / (self._n_routed * cfg.n_expert_used)
        return float(cfg.n_expert * (f * self._pmean.astype(np.float64)).sum())

    # ---- forward ----
    def _forward_body(self, Bp, Tp):
        cfg, ops, p = self.cfg, self.ops, self.p
        N, C, F = Bp * Tp, cfg.n_embd, cfg.n_ff
        Ckv = cfg.kv_heads * cfg.head_dim
        if cfg.n_expert and self._fixed_routing and self._n_routed != N:
            raise ClgptError("freeze_routing: the routing was recorded for another batch shape")
        x0 = self.acts[0]["x"] if cfg.n_layer else self.x_out
        ops.embedding_forward(N, Tp, self.tokens, p["token_embd.weight"], self.zero_pos, x0)
        if self._drop:
            ops.dropout_forward(N * C, *self._dropped(-1, "embd"), x0, x0)
        for i, a in enumerate(self.acts):
            pre = f"blk.{i}."
            x_next = self.acts[i + 1]["x"] if i + 1 < cfg.n_layer else self.x_out
            ops.rmsnorm(N, a["x"], p[pre + "attn_norm.weight"], a["ln1"], a["r1"])
            hqkv = a["qkv"] if Ckv == C else self.hqkv  # q | k | v (N, C + 2Ckv)
            ops.matmul(N, C + 2 * Ckv, C, a["ln1"], p[pre + "attn_q+k+v"], hqkv, tb=1)
            drop = self._dropped(i, "attn")  # attention over qkv = rope(hqkv): the launchers place the rotation
            ops.attention_forward(Bp, Tp, a["qkv"], a["atty"], a["att"], drop and (*drop, a.get("att_d")),
                                  rope=(hqkv, self.rope_cos, self.rope_sin))
            if self._drop:
                ops.matmul(N, C, C, a["atty"], p[pre + "attn_output.weight"], self.branch, tb=1)
                self._residual(N * C, i, "attn_res", a["x"], self.branch, a["x_mid"])
            else:
                ops.matmul(N, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], tb=1, resid=a["x"])
            ops.rmsnorm(N, a["x_mid"], p[pre + "ffn_norm.weight"], a["ln2"], a["r2"])
            out, resid = (self.branch, None) if self._drop else (x_next, a["x_mid"])
            if cfg.n_expert:
                self._moe_forward(i, a, N, resid if resid is not None else self.zero_res, out)
            else:
                ops.matmul(N, 2 * F, C, a["ln2"], p[pre + "ffn_gate+up"], a["hgu"], tb=1)
                ops.swiglu_rows_forward(N, a["hgu"], a["act"], products_only=True)  # read by the down products alone
                ops.matmul(N, C, F, a["act"], p[pre + "ffn_down.weight"], out, tb=1, resid=resid)
            if self._drop:
                self._residual(N * C, i, "ffn_res", a["x_mid"], self.branch, x_next)
        ops.rmsnorm(N, self.x_out, p["output_norm.weight"], self.lnf, self.rf)

    def _moe_forward(self, i, a, N, resid, out):
        """out = resid + sum_k w_k expert_{sel_k}(ln2): route, gather, the experts (grouped products), combine."""
        cfg, ops, p, pre = self.cfg, self.ops, self.p, f"blk.{i}."
        C, E = cfg.n_embd, cfg.n_expert
        ops.moe_router_forward(N, self._fixed_routing, a["ln2"], p[pre + "ffn_gate_inp.weight"], self.rlogits,
                               a["probs"], a["sel"], a["w"])
        ops.moe_route(N, a["probs"], a["sel"], a["pos"], a["counts"], a["offs"], a["tiles"], a["pmean"])
        self._n_routed = N  # counts and pmean stay on the device until expert_usage / aux_loss ask
        ops.moe_gather(N, self.R, a["pos"], a["ln2"], a["xg"])
        route = (a["counts"], a["offs"], a["tiles"])
        ops.moe_experts_forward(E, self.max_tiles, self.R, route, a["xg"],
                                [p[f"{pre}{name}.weight"] for name in _EXPERT_MATS], a["hgu"], a["act"], a["ye"])
        ops.runp("moe_combine_forward", (C, N), i32(N), resid, a["w"], a["pos"], a["ye"], out)

    # ---- backward ----
    def _backward_body(self, Bp, Tp, scale):
        """Accumulates scale * d(loss + moe_aux_loss * aux)/dparams."""
        cfg, ops, p, g = self.cfg, self.ops, self.p, self.g
        N, C, F = Bp * Tp, cfg.n_embd, cfg.n_ff
        Ckv = cfg.kv_heads * cfg.head_dim
        dx, dln = self.dx, self.dln
        # dx_copy: where dx's next readers are a linear_backward's products (no dropout between; dense blocks)
        dense = not self._drop and not cfg.n_expert
        ops.rmsnorm_backward(N, dln, self.x_out, self.rf, p["output_norm.weight"], g["output_norm.weight"], dx, 0,
                             dx_copy=dense and cfg.n_layer > 0)
        for i in reversed(range(cfg.n_layer)):
            pre, a = f"blk.{i}.", self.acts[i]
            dy = self._branch_grad(N, C, i, "ffn_res")
            if cfg.n_expert:
                self._moe_backward(i, a, N, scale, dy)
            else:  # x_out = x_mid + act @ Wdown.T, act = silu(hgu[:, :F]) * hgu[:, F:], hgu = ln2 @ [Wg; Wu].T
                # dact = dy @ Wdown, and in its epilogue dhgu = dgate | dup (kernels/epilogue.cl EPI 3)
                ops.linear_backward(N, C, F, dy, a["act"], p[pre + "ffn_down.weight"], g[pre + "ffn_down.weight"],
                                    self.dhgu, epi=3, E=a["hgu"], ldc=2 * F)
                ops.linear_backward(N, 2 * F, C, self.dhgu, a["ln2"], p[pre + "ffn_gate+up"], g[pre + "ffn_gate+up"],
                                    dln)
            ops.rmsnorm_backward(N, dln, a["x_mid"], a["r2"], p[pre + "ffn_norm.weight"], g[pre + "ffn_norm.weight"],
                                 dx, 1, dx_copy=not self._drop)
            # attention: x_mid = x + drop(atty @ Wo.T)
            dy = self._branch_grad(N, C, i, "attn_res")
            ops.linear_backward(N, C, C, dy, a["atty"], p[pre + "attn_output.weight"], g[pre + "attn_output.weight"],
                                self.datty)
            drop = self._dropped(i, "attn")
            dh = self.dqkv if Ckv == C else self.dhqkv  # the q | k | v product's gradient (N, C + 2Ckv)
            ops.attention_backward(Bp, Tp, self.datty, a["qkv"], a["att"], self.datt, self.dqkv,
                                   drop and (*drop, a.get("att_d")), out=a["atty"],
                                   rope=(dh, self.rope_cos, self.rope_sin), products_only=True)
            ops.linear_backward(N, C + 2 * Ckv, C, dh, a["ln1"], p[pre + "attn_q+k+v"], g[pre + "attn_q+k+v"], dln)
            ops.rmsnorm_backward(N, dln, a["x"], a["r1"], p[pre + "attn_norm.weight"], g[pre + "attn_norm.weight"],
                                 dx, 1, dx_copy=dense and i > 0)
            self._layer_done(i)  # blk.i.* gradients final: data-parallel ranks may sum them now
        if self._drop:
            ops.dropout_backward(N * C, *self._dropped(-1, "embd"), dx)
        self._token_embd_backward(N, dx)

    def _moe_backward(self, i, a, N, scale, dy):
        """dy: the gradient reaching the MoE output; leaves the gradient of ln2 in dln."""
        cfg, ops, pre, p, g = self.cfg, self.ops, f"blk.{i}.", self.p, self.g
        E, K = cfg.n_expert, cfg.n_expert_used
        route = (a["counts"], a["offs"], a["tiles"])
        ops.moe_combine_backward(N, self.R, dy, a["w"], a["pos"], self.dye)
        ops.moe_weight_backward(N, dy, a["pos"], a["ye"], self.dwsel)
        ops.moe_experts_backward(E, self.max_tiles, self.R, N, route, self.dye, a["xg"], a["hgu"], a["act"],
                                 [p[f"{pre}{name}.weight"] for name in _EXPERT_MATS],
                                 [g[f"{pre}{name}.weight"] for name in _EXPERT_MATS], self.dact, self.dhgu, self.dxg)
        aux_scale = scale * cfg.moe_aux_loss * E / (float(N) * N * K)
        ops.moe_router_backward(N, aux_scale, self.dwsel, a, a["ln2"], p[pre + "ffn_gate_inp.weight"],
                                g[pre + "ffn_gate_inp.weight"], self.drlogits, self.dxg, self.dln)


def _rope_tables(T: int, D: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (T, D/2) float32 of t * base^(-2i/D), computed in float64."""
    theta = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * theta[None]
    return np.ascontiguousarray(np.cos(ang), np.float32), np.ascontiguousarray(np.sin(ang), np.float32)

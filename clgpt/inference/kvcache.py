"""Decoding with a key/value cache on any engine (gpt2, llama dense or mixture of experts).

`prefill` runs the engine's own forward over the prompts (B', W) once and copies each layer's keys and values
(the rows of its qkv buffer, RoPE'd for llama, kv heads repeated) into the cache; `step` then runs one token a
sequence through the blocks with T = 1: the engine's launchers for the norms, SwiGLU and the MoE route on the first
B' rows of its buffers; kernels/gemv.cl for the dense products (a few rows against weights read in place: the
engine's CPU GEMM would copy each weight transposed per call, more work than the product itself at B' rows); and
kernels/kvcache.cl for what depends on the position: the embedding (gpt2's position row), RoPE and the new
key/value row, and one query's attention over the cache.

Shapes: B' sequences (at most the engine's B), C n_embd, V vocab; the cache holds (B, T, C) keys and values a
layer, T the engine's seq_len (a position must lie below it). Each sequence has its own position, so prompts of
different lengths decode together (the evaluate stage's batches).
"""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl

from clgpt.errors import ClgptError
from clgpt.ops import F32

i32 = np.int32


class KVCache:
    def __init__(self, engine):
        self.eng = eng = engine
        cfg, ops, dev = eng.cfg, eng.ops, eng.dev
        self.cfg, self.ops, self.queue = cfg, ops, eng.queue
        B, T, C = eng.B, eng.T, cfg.n_embd
        llama = cfg.arch == "llama"
        ckv = cfg.kv_heads * cfg.head_dim if llama else C
        defines = dict(C=C, D=cfg.head_dim, CKV=ckv, G=cfg.n_head * cfg.head_dim // ckv, TMAX=T,
                       SCALE=float(1.0 / math.sqrt(cfg.head_dim)), ROPE=int(llama), POS_EMBD=int(not llama))
        self.k = {name: dev.kernel("kvcache", name, **defines) for name in ("embed_at", "kv_append", "attention_decode")}
        mf = cl.mem_flags
        self.kc = [ops.buf(B * T * C) for _ in range(cfg.n_layer)]  # keys (B, T, C) a layer
        self.vc = [ops.buf(B * T * C) for _ in range(cfg.n_layer)]
        self.q = ops.buf(B * C)  # this step's queries (B, C)
        # tokens and positions in one buffer, written by one copy a step: pos starts at an aligned offset
        align = max(dev.device.mem_base_addr_align // 8, 4)
        self._pos_at = -(-B * 4 // align) * align
        self._tp = cl.Buffer(eng.ctx, mf.READ_ONLY, self._pos_at + B * 4)
        self._tp_host = np.zeros((self._pos_at + B * 4) // 4, np.int32)
        self.tokens = self._tp.get_sub_region(0, B * 4)
        self.pos = self._tp.get_sub_region(self._pos_at, B * 4)
        if llama:
            self.wpe, self.cos, self.sin = eng.zero_pos, eng.rope_cos, eng.rope_sin
        else:  # no RoPE: the tables are unread, any buffer stands in
            self.wpe = self.cos = self.sin = eng.p["position_embd.weight"]
        self._host = None
        self._gemv = {}
        self._plans = {}  # B' -> the step's launches, arguments set once (llama, dense: _llama_plan)
        self.fused = llama and not cfg.n_expert and cfg.n_layer > 0 and self._fits(max(C, cfg.n_ff))

    # ---- prefill ----
    def prefill(self, tokens, last) -> np.ndarray:
        """Logits (B', V) at position last[b] of each row of tokens (B', W), as engine.next_logits gives them;
        the cache then holds positions 0..W-1 of every row (those past a row's last token are overwritten by
        its later steps before they are read)."""
        logits = self.eng.next_logits(tokens, last)
        Bp, W = np.shape(tokens)
        C, T = self.cfg.n_embd, self.eng.T
        for a, kc, vc in zip(self.eng.acts, self.kc, self.vc):
            if self.cfg.arch == "llama":  # keys rotated as attention used them (it may have rotated only its copy)
                self.ops.rotated_qkv(Bp * W, W, a["qkv"], self.cos, self.sin)
            for col, cache in ((C, kc), (2 * C, vc)):  # qkv (B'*W, 3C): k at columns C.., v at 2C..
                cl.enqueue_copy(self.queue, cache, a["qkv"], src_origin=(col * F32, 0, 0), dst_origin=(0, 0, 0),
                                region=(C * F32, W, Bp), src_pitches=(3 * C * F32, W * 3 * C * F32),
                                dst_pitches=(C * F32, T * C * F32))
        return logits

    # ---- one step ----
    def step(self, tokens, pos) -> np.ndarray:
        """Logits (B', V) of token tokens[b] at position pos[b] of sequence b, after the cached positions
        0..pos[b]-1; its key and value join the cache."""
        eng, ops, cfg = self.eng, self.ops, self.cfg
        tokens = [int(t) for t in np.ravel(tokens)]
        pos = [int(t) for t in np.ravel(pos)]
        Bp = len(tokens)
        if not 0 < Bp <= eng.B or len(pos) != Bp:
            raise ClgptError(f"step: {Bp} tokens and {len(pos)} positions for a cache of {eng.B} sequences")
        if min(pos) < 0 or max(pos) >= eng.T:
            raise ClgptError(f"step: positions must lie in [0, {eng.T}), got {min(pos)}..{max(pos)}")
        if min(tokens) < 0 or max(tokens) >= cfg.vocab_size:
            raise ClgptError(f"step: token ids must lie in [0, {cfg.vocab_size})")
        eng._fwd = None
        ops.forget_copies()  # the stable buffers are written again
        tp = self._tp_host  # the last step's copy from it is done: that step ended with a blocking read
        tp[:Bp] = tokens
        tp[self._pos_at // 4:self._pos_at // 4 + Bp] = pos
        cl.enqueue_copy(self.queue, self._tp, tp, is_blocking=False)
        if self.fused:
            plan = self._plans.get(Bp) or self._plans.setdefault(Bp, self._llama_plan(Bp))
            for kern, gsize, lsize in plan:
                ops.launcher.launch_set(kern, gsize, lsize)
        else:
            self._step_by_op(Bp)
        out = np.empty((Bp, cfg.vocab_size), np.float32)
        cl.enqueue_copy(self.queue, out, eng.logits, is_blocking=True)
        return out

    def _step_by_op(self, Bp):
        """The step as the engine's own launchers and the decode kernels, one op a launch (gpt2, MoE)."""
        eng, ops, cfg = self.eng, self.ops, self.cfg
        C, V = cfg.n_embd, cfg.vocab_size
        x0 = eng.acts[0]["x"] if cfg.n_layer else eng.x_out
        self._run("embed_at", (C, Bp), i32(Bp), self.tokens, self.pos, eng.p["token_embd.weight"], self.wpe, x0)
        block = self._llama_block if cfg.arch == "llama" else self._gpt2_block
        for i, a in enumerate(eng.acts):
            block(i, a, eng.acts[i + 1]["x"] if i + 1 < cfg.n_layer else eng.x_out, Bp)
        if cfg.arch == "llama":
            ops.rmsnorm(Bp, eng.x_out, eng.p["output_norm.weight"], eng.lnf, eng.rf)
        else:
            ops.layernorm(Bp, eng.x_out, eng.p["output_norm.weight"], eng.p["output_norm.bias"], eng.lnf,
                          eng.lnf_mean, eng.lnf_rstd)
        self.gemv(Bp, V, C, eng.lnf, eng._w_out(), eng.logits)

    # ---- a dense llama step: five launches a block (kernels/gemv.cl gemv_pairs), their arguments set once ----
    def _fits(self, K) -> bool:
        """Whether gemv_pairs' local row (K floats and the norm's partial sums) fits the device's local memory."""
        return (K + self.ops.launch["local_1d"]) * F32 <= self.eng.dev.device.local_mem_size

    def _pairs(self, Bp, N, K, x, W, y, norm_w=None, resid=None, epi=0, embed=False, i=0):
        """One gemv_pairs launch: (cl.Kernel with its arguments set, global size, local size)."""
        cfg = self.cfg
        lw = self.ops.launch["local_1d"]
        defines = dict(K=K, NORM=int(norm_w is not None), EMBED=int(embed), EPI=epi, RESID=int(resid is not None),
                       LW=lw, EPS=float(cfg.norm_eps))
        if epi == 1:
            ckv = cfg.kv_heads * cfg.head_dim
            defines.update(C=cfg.n_embd, D=cfg.head_dim, CKV=ckv, G=cfg.n_head * cfg.head_dim // ckv, TMAX=self.eng.T)
        built = self.eng.dev.kernel("gemv", "gemv_pairs", **defines)
        kern = cl.Kernel(built.program, "gemv_pairs")  # a kernel object a launch: each keeps its own arguments
        p = self.eng.p
        kern.set_args(i32(Bp), i32(N), x, self.tokens, p["token_embd.weight"], norm_w, W, resid, y, self.pos,
                      self.cos, self.sin, self.kc[i], self.vc[i])
        pairs = -(-N // 2) if epi != 2 else N // 2
        return kern, (-(-pairs // lw) * lw, Bp), (lw, 1)

    def _llama_plan(self, Bp):
        eng, cfg, p = self.eng, self.cfg, self.eng.p
        C, F, H = cfg.n_embd, cfg.n_ff, cfg.n_head
        ckv = cfg.kv_heads * cfg.head_dim
        lsize = tuple(self.ops.launch["local_2d"])
        plan = []
        for i, a in enumerate(eng.acts):
            pre, x_next = f"blk.{i}.", eng.acts[i + 1]["x"] if i + 1 < cfg.n_layer else eng.x_out
            plan.append(self._pairs(Bp, C + 2 * ckv, C, a["x"], p[pre + "attn_q+k+v"], self.q,
                                    norm_w=p[pre + "attn_norm.weight"], epi=1, embed=i == 0, i=i))
            attend = cl.Kernel(self.k["attention_decode"].program, "attention_decode")
            attend.set_args(i32(Bp), self.q, self.kc[i], self.vc[i], self.pos, a["atty"])
            plan.append((attend, tuple(-(-g // l) * l for g, l in zip((H, Bp), lsize)), lsize))
            plan.append(self._pairs(Bp, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], resid=a["x"]))
            plan.append(self._pairs(Bp, 2 * F, C, a["x_mid"], p[pre + "ffn_gate+up"], a["act"],
                                    norm_w=p[pre + "ffn_norm.weight"], epi=2))
            plan.append(self._pairs(Bp, C, F, a["act"], p[pre + "ffn_down.weight"], x_next, resid=a["x_mid"]))
        plan.append(self._pairs(Bp, cfg.vocab_size, C, eng.x_out, eng._w_out(), eng.logits,
                                norm_w=p["output_norm.weight"]))
        return plan

    def gemv(self, Bp, N, K, x, W, y, bias=None, resid=None, gelu=None):
        """y (B', N) = x (B', K) @ W.T [+ bias] [+ resid] with W (N, K) read in place (kernels/gemv.cl); gelu: a
        buffer that also receives gelu(y)."""
        key = (K, bias is not None, resid is not None, gelu is not None)
        kern = self._gemv.get(key)
        if kern is None:
            kern = self._gemv[key] = self.eng.dev.kernel("gemv", "gemv_nt", K=K, BIAS=int(key[1]), RESID=int(key[2]),
                                                         GELU=int(key[3]))
        lsize = tuple(self.ops.launch["local_2d"])
        gsize = (-(-N // lsize[0]) * lsize[0], -(-Bp // lsize[1]) * lsize[1])
        self.ops.launcher.launch(kern, gsize, lsize, (i32(Bp), i32(N), x, W, bias, resid, y, gelu))

    def _run(self, name, gsize, *args):
        """A launch at the device's fixed 2-D local size, the global size padded to it (the kernels bound-check):
        PoCL builds a kernel once per local size, so sizes that change with B' must not pick new ones."""
        lsize = tuple(self.ops.launch["local_2d"])
        self.ops.launcher.launch(self.k[name], tuple(-(-g // l) * l for g, l in zip(gsize, lsize)), lsize, args)

    def _attend(self, i, src, Bp, out):
        """out (B', C): this step's attention, after appending its keys and values from src (B', C + 2Ckv)."""
        H = self.cfg.n_head
        self._run("kv_append", (3 * H, Bp), i32(Bp), src, self.pos, self.cos, self.sin, self.q, self.kc[i],
                  self.vc[i])
        self._run("attention_decode", (H, Bp), i32(Bp), self.q, self.kc[i], self.vc[i], self.pos, out)

    def _gpt2_block(self, i, a, x_next, Bp):
        cfg, ops, p, pre = self.cfg, self.ops, self.eng.p, f"blk.{i}."
        C, F = cfg.n_embd, cfg.n_ff
        ops.layernorm(Bp, a["x"], p[pre + "attn_norm.weight"], p[pre + "attn_norm.bias"], a["ln1"], a["ln1_mean"],
                      a["ln1_rstd"])
        self.gemv(Bp, 3 * C, C, a["ln1"], p[pre + "attn_qkv.weight"], a["qkv"], bias=p[pre + "attn_qkv.bias"])
        self._attend(i, a["qkv"], Bp, a["atty"])
        self.gemv(Bp, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], bias=p[pre + "attn_output.bias"],
                  resid=a["x"])
        ops.layernorm(Bp, a["x_mid"], p[pre + "ffn_norm.weight"], p[pre + "ffn_norm.bias"], a["ln2"], a["ln2_mean"],
                      a["ln2_rstd"])
        self.gemv(Bp, F, C, a["ln2"], p[pre + "ffn_up.weight"], a["h"], bias=p[pre + "ffn_up.bias"], gelu=a["g"])
        self.gemv(Bp, C, F, a["g"], p[pre + "ffn_down.weight"], x_next, bias=p[pre + "ffn_down.bias"],
                  resid=a["x_mid"])

    def _llama_block(self, i, a, x_next, Bp):
        cfg, ops, eng, pre = self.cfg, self.ops, self.eng, f"blk.{i}."
        p, C, F = eng.p, cfg.n_embd, cfg.n_ff
        Ckv = cfg.kv_heads * cfg.head_dim
        ops.rmsnorm(Bp, a["x"], p[pre + "attn_norm.weight"], a["ln1"], a["r1"])
        self.gemv(Bp, C + 2 * Ckv, C, a["ln1"], p[pre + "attn_q+k+v"], a["qkv"])  # (B', C + 2Ckv)
        self._attend(i, a["qkv"], Bp, a["atty"])
        self.gemv(Bp, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], resid=a["x"])
        ops.rmsnorm(Bp, a["x_mid"], p[pre + "ffn_norm.weight"], a["ln2"], a["r2"])
        if cfg.n_expert:
            eng._moe_forward(i, a, Bp, a["x_mid"], x_next)
        else:
            self.gemv(Bp, 2 * F, C, a["ln2"], p[pre + "ffn_gate+up"], a["hgu"])
            ops.swiglu_rows_forward(Bp, a["hgu"], a["act"])
            self.gemv(Bp, C, F, a["act"], p[pre + "ffn_down.weight"], x_next, resid=a["x_mid"])

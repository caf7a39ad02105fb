"""GPT2Engine: the GPT-2 forward and backward, written against the launchers of clgpt.ops.

    x = drop(token_embd[tokens] + position_embd[0..T-1])
    for each block:  x = x + drop(attn_output(attn(split(attn_qkv(ln(x, attn_norm))))))   (drop on att too)
                     x = x + drop(ffn_down(gelu(ffn_up(ln(x, ffn_norm)))))
    logits = ln(x, output_norm) @ (output.weight or token_embd.weight).T      (head: clgpt.models.base)

Shapes: B batch, T time, N = B*T rows, C n_embd, H heads, F n_ff, L layers. drop is dropout (clgpt.models.dropout),
only in a forward with targets and a dropout_seed; without it the residual adds fuse into the matmuls.
"""

from __future__ import annotations

from clgpt.models.base import EngineBase


class GPT2Engine(EngineBase):
    arch = "gpt2"
    saved = ("ln1", "atty", "ln2", "g")  # the products' inputs the backward reads again

    def _alloc(self):
        self.ops.build_gpt2()
        cfg, B, T, buf = self.cfg, self.B, self.T, self.ops.buf
        N, C, F, H = B * T, cfg.n_embd, cfg.n_ff, cfg.n_head
        self.acts = []
        for _ in range(cfg.n_layer):
            a = dict(x=buf(N * C), ln1=buf(N * C), ln1_mean=buf(N), ln1_rstd=buf(N), qkv=buf(N * 3 * C),
                     att=buf(self.ops.att_floats(B, T)), atty=buf(N * C), x_mid=buf(N * C), ln2=buf(N * C), ln2_mean=buf(N),
                     ln2_rstd=buf(N), h=buf(N * F), g=buf(N * F))
            if self.dropout and not (self.ops.flash or self.ops.flash_portable):  # flash redraws the mask
                a["att_d"] = buf(B * H * T * T)  # the dropped attention probabilities
            self.acts.append(a)
        self.lnf_mean, self.lnf_rstd = buf(N), buf(N)
        # backward scratch, shared by every layer
        self.datty, self.dqkv = buf(N * C), buf(N * 3 * C)
        self.dh, self.datt = buf(N * F), buf(self.ops.att_floats(B, T))
        if self.dropout:  # a residual branch before its dropout (forward), its gradient after (backward)
            self.branch, self.dres = buf(N * C), buf(N * C)

    def _product_weights(self):
        C, F = self.cfg.n_embd, self.cfg.n_ff
        return super()._product_weights() + [
            (f"blk.{i}.{name}.weight", rows, cols) for i in range(self.cfg.n_layer)
            for name, rows, cols in (("attn_qkv", 3 * C, C), ("attn_output", C, C), ("ffn_up", F, C),
                                     ("ffn_down", C, F))]

    def _forward_body(self, Bp, Tp):
        cfg, ops, p = self.cfg, self.ops, self.p
        N, C, F = Bp * Tp, cfg.n_embd, cfg.n_ff
        x0 = self.acts[0]["x"] if cfg.n_layer else self.x_out
        ops.embedding_forward(N, Tp, self.tokens, p["token_embd.weight"], p["position_embd.weight"], x0)
        if self._drop:
            ops.dropout_forward(N * C, *self._dropped(-1, "embd"), x0, x0)
        for i, a in enumerate(self.acts):
            pre = f"blk.{i}."
            x_next = self.acts[i + 1]["x"] if i + 1 < cfg.n_layer else self.x_out
            ops.layernorm(N, a["x"], p[pre + "attn_norm.weight"], p[pre + "attn_norm.bias"], a["ln1"], a["ln1_mean"],
                          a["ln1_rstd"])
            drop = self._dropped(i, "attn")  # qkv = ln1 @ Wqkv^T + b, then attention
            ops.attention_forward(Bp, Tp, a["qkv"], a["atty"], a["att"], drop and (*drop, a.get("att_d")),
                                  product=(a["ln1"], p[pre + "attn_qkv.weight"], p[pre + "attn_qkv.bias"]),
                                  qkv_read=not self._with_targets)  # the KV cache's prefill reads qkv
            if self._drop:
                ops.matmul(N, C, C, a["atty"], p[pre + "attn_output.weight"], self.branch, tb=1,
                           bias=p[pre + "attn_output.bias"])
                self._residual(N * C, i, "attn_res", a["x"], self.branch, a["x_mid"])
            else:
                ops.matmul(N, C, C, a["atty"], p[pre + "attn_output.weight"], a["x_mid"], tb=1,
                           bias=p[pre + "attn_output.bias"], resid=a["x"])
            ops.layernorm(N, a["x_mid"], p[pre + "ffn_norm.weight"], p[pre + "ffn_norm.bias"], a["ln2"], a["ln2_mean"],
                          a["ln2_rstd"])
            ops.matmul_epi(N, F, C, a["ln2"], p[pre + "ffn_up.weight"], a["h"], tb=1, bias=p[pre + "ffn_up.bias"],
                           epi=1, E=a["g"])  # h, and g = gelu(h)
            if self._drop:
                ops.matmul(N, C, F, a["g"], p[pre + "ffn_down.weight"], self.branch, tb=1,
                           bias=p[pre + "ffn_down.bias"])
                self._residual(N * C, i, "ffn_res", a["x_mid"], self.branch, x_next)
            else:
                ops.matmul(N, C, F, a["g"], p[pre + "ffn_down.weight"], x_next, tb=1, bias=p[pre + "ffn_down.bias"],
                           resid=a["x_mid"])
        ops.layernorm(N, self.x_out, p["output_norm.weight"], p["output_norm.bias"], self.lnf, self.lnf_mean,
                      self.lnf_rstd)

    def _backward_body(self, Bp, Tp, scale):
        cfg, ops, p, g = self.cfg, self.ops, self.p, self.g
        N, C, F = Bp * Tp, cfg.n_embd, cfg.n_ff
        dx, dln = self.dx, self.dln
        # dx_copy: dx's next readers are a linear_backward's products (and its bias gradient, whose column sums
        # then come with the copy: dx_colsums), no dropout between
        copy, sums = not self._drop, cfg.bias
        ops.layernorm_backward(N, dln, self.x_out, self.lnf_mean, self.lnf_rstd, p["output_norm.weight"],
                               g["output_norm.weight"], g["output_norm.bias"], dx, accum=0,
                               dx_copy=copy and cfg.n_layer > 0, dx_colsums=sums)
        for i in reversed(range(cfg.n_layer)):
            pre, a = f"blk.{i}.", self.acts[i]
            # ffn: x_out = x_mid + drop(g @ Wdown.T + b)
            dy = self._branch_grad(N, C, i, "ffn_res")
            # the bias gradients only where biases train (cfg.bias; ParamStore's trains)
            db = (lambda name: g[pre + name + ".bias"] if cfg.bias else None)  # noqa: E731
            ops.linear_backward(N, C, F, dy, a["g"], p[pre + "ffn_down.weight"], g[pre + "ffn_down.weight"], self.dh,
                                db("ffn_down"), epi=2, E=a["h"])  # dh = dg * gelu'(h)
            ops.linear_backward(N, F, C, self.dh, a["ln2"], p[pre + "ffn_up.weight"], g[pre + "ffn_up.weight"], dln,
                                db("ffn_up"))
            ops.layernorm_backward(N, dln, a["x_mid"], a["ln2_mean"], a["ln2_rstd"], p[pre + "ffn_norm.weight"],
                                   g[pre + "ffn_norm.weight"], g[pre + "ffn_norm.bias"], dx, accum=1, dx_copy=copy,
                                   dx_colsums=sums)
            # attention: x_mid = x + drop(atty @ Wo.T + b)
            dy = self._branch_grad(N, C, i, "attn_res")
            ops.linear_backward(N, C, C, dy, a["atty"], p[pre + "attn_output.weight"], g[pre + "attn_output.weight"],
                                self.datty, db("attn_output"))
            drop = self._dropped(i, "attn")
            ops.attention_backward(Bp, Tp, self.datty, a["qkv"], a["att"], self.datt, self.dqkv,
                                   drop and (*drop, a.get("att_d")), out=a["atty"])
            ops.linear_backward(N, 3 * C, C, self.dqkv, a["ln1"], p[pre + "attn_qkv.weight"],
                                g[pre + "attn_qkv.weight"], dln, db("attn_qkv"))
            ops.layernorm_backward(N, dln, a["x"], a["ln1_mean"], a["ln1_rstd"], p[pre + "attn_norm.weight"],
                                   g[pre + "attn_norm.weight"], g[pre + "attn_norm.bias"], dx, accum=1,
                                   dx_copy=copy and i > 0, dx_colsums=sums)
            self._layer_done(i)  # blk.i.* gradients final: data-parallel ranks may sum them now
        if self._drop:
            ops.dropout_backward(N * C, *self._dropped(-1, "embd"), dx)
        self._token_embd_backward(N, dx)
        ops.position_embd_backward(Bp, Tp, dx, g["position_embd.weight"])

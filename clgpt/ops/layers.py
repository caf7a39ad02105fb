"""The other layers' launchers: cross-entropy (plain, and label-smoothed where the engine trains so), embeddings,
Llama's RoPE and SwiGLU, dropout, and the optimizer's gradient norm and AdamW over flat parameter buffers
(clgpt/models/params.py).

Launches kernels/xent.cl, kernels/embedding.cl, kernels/rope.cl, kernels/swiglu.cl, kernels/dropout.cl (masks from
clgpt.models.dropout's hash of seed, site, element) and kernels/adamw.cl.
"""

from __future__ import annotations

import numpy as np

from clgpt.errors import ClgptError
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32


class Layers(Part):
    """Cross-entropy, embedding, RoPE, SwiGLU, dropout, grad norm and AdamW; `gemm`, the GEMM backend, says which
    products run on wgmma and keeps the tiled copies (its `copies`) some of these write for them.
    label_smoothing (in [0, 1), the caller checks it): the smoothed cross-entropy's kernels are built beside the
    plain ones when it is > 0, and a loss asks for them with `smoothed`."""

    def __init__(self, f: Facts, gemm, label_smoothing: float = 0.0):
        super().__init__(f)
        self.gemm, self.copies = gemm, gemm.copies
        cfg, dev, k, launch, caps = self.cfg, self.dev, self.k, self.launch, self.caps
        C = cfg.n_embd
        k["embedding_forward"] = dev.kernel("embedding", "embedding_forward", C=C)
        if caps.embedding_rows:  # CPUs: a row a work-item, float8
            k["embedding_forward_rows"] = dev.kernel("embedding", "embedding_forward_rows", C=C)
        k["embedding_backward_wte"] = dev.kernel("embedding", "embedding_backward_wte", C=C)
        self.label_smoothing = float(label_smoothing)
        self._half_logits = None  # the logits buffer head_logits last wrote as bf16
        self._build_xent("")
        if self.label_smoothing > 0:  # the held-out loss of a run that trains smoothed still takes the plain ones
            self._build_xent("_ls", LS=self.label_smoothing)
        for kname in ("grad_norm_partial", "grad_norm_final", "adamw"):
            k[kname] = dev.kernel("adamw", kname, STRIDED=int(launch["norm_parts"] > 256))
        if caps.grad_norm_groups:  # GPUs: the norm's sums as work-groups
            for kname in ("grad_norm_partial_wg", "grad_norm_final_wg"):
                k[kname] = dev.kernel("adamw", kname, LW=f.rows, **f.sg)
        if caps.adamw_v8:  # CPUs: float8 AdamW (kernels/adamw.cl)
            k["adamw_v8"] = dev.kernel("adamw", "adamw_v8", STRIDED=int(launch["norm_parts"] > 256))
        if caps.grad_norm_v8:  # chunked partial sums (not STRIDED): float8 chains
            k["grad_norm_partial"] = dev.kernel("adamw", "grad_norm_partial_v8", STRIDED=int(launch["norm_parts"] > 256))
        for kname in ("dropout_forward", "dropout_residual", "dropout_backward"):
            k[kname] = dev.kernel("dropout", kname)

    def _build_xent(self, suffix: str, **ls):
        """The cross-entropy kernels a device launches, named with `suffix`; `ls`: {"LS": eps} for the smoothed ones
        ({}: the build options, and so the programs, are those of a model without label smoothing)."""
        f, dev, k, V = self.f, self.dev, self.k, self.cfg.vocab_size
        for kname in ("xent_forward", "xent_backward"):
            k[kname + suffix] = dev.kernel("xent", kname, V=V, **ls)
        if self.caps.xent_fused:  # CPUs: loss and unscaled gradient in one vectorised pass per row
            k["xent_fused" + suffix] = dev.kernel("xent", "xent_fused", V=V, **ls)
        if f.rows:
            k["xent_forward_wg" + suffix] = dev.kernel("xent", "xent_forward_wg", V=V, LW=f.rows, **f.sg, **ls)
        if f.wgmma is not None:
            k["xent_backward_tiled" + suffix] = dev.kernel("xent", "xent_backward_tiled", V=V, **ls)
            if f.rows:  # on bf16 logits (head_logits)
                k["xent_forward_wg_h" + suffix] = dev.kernel("xent", "xent_forward_wg", V=V, LW=f.rows, **f.sg,
                                                             LOGITS_BF16=1, **ls)
                k["xent_backward_tiled_h" + suffix] = dev.kernel("xent", "xent_backward_tiled", V=V, LOGITS_BF16=1,
                                                                 **ls)

    def _xent_suffix(self, smoothed: bool) -> str:
        return "_ls" if smoothed and self.label_smoothing > 0 else ""

    def build_gpt2(self):
        """GPT-2's own: the position embedding's gradient."""
        self.k["embedding_backward_wpe"] = self.dev.kernel("embedding", "embedding_backward_wpe", C=self.cfg.n_embd)

    def build_llama(self):
        """Llama's own: RoPE with the q | k | v packing, SwiGLU."""
        f, cfg, dev, k = self.f, self.cfg, self.dev, self.k
        C, D = cfg.n_embd, cfg.head_dim
        for kname in ("rope_forward", "rope_backward"):  # CPUs: 4 pairs a step (ROPE_VEC), the same bits
            k[kname] = dev.kernel("rope", kname, C=C, D=D, G=cfg.n_head // cfg.kv_heads, CKV=cfg.kv_heads * D,
                                  **({"ROPE_VEC": 1} if f.rope_vec else {}))
        for kname in ("swiglu_forward", "swiglu_backward"):  # mixture of experts: gate, up apart
            k[kname] = dev.kernel("swiglu", kname)
        # dense: h = gate | up per row (the backward is the dact product's epilogue 3)
        # CPUs with 16-float vectors (the matmul row's VW 16: AVX-512) take float16 blocks, the same bits
        wide = {"SW": 16} if f.mm.get("kernel") == "matmul_rb" and f.mm.get("VW") == 16 else {}
        k["swiglu_rows_forward"] = dev.kernel("swiglu", "swiglu_rows_forward", F=cfg.n_ff, **wide)
        if self.caps.swiglu_per_element:
            self._build_swiglu_gpu()
        if self.caps.rope_per_pair:
            for kname in ("rope_forward_el", "rope_backward_el"):  # one work-item a pair
                k[kname] = dev.kernel("rope", kname, C=C, D=D, G=cfg.n_head // cfg.kv_heads, CKV=cfg.kv_heads * D)

    def _build_swiglu_gpu(self):
        """The dense SwiGLU forward spread over a GPU: 4 outputs a work-item (F % 4 == 0; with the output's tiled
        copy where the products read one and F % 64 == 0), else one."""
        F, dev = self.cfg.n_ff, self.dev
        if F % 4:
            self.k["swiglu_rows_forward_el"] = dev.kernel("swiglu", "swiglu_rows_forward_el", F=F)
            return
        self.k["swiglu_rows_forward_v4"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F)
        if self.f.tiled_outputs and F % 64 == 0:
            self.k["swiglu_rows_forward_v4_tiled"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F, SWIGLU_TILED=1)
            self.k["swiglu_rows_forward_v4_tiled_only"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F,
                                                                     SWIGLU_TILED=2)

    def head_logits(self, N, C, x, W, logits, for_loss: bool):
        """logits (N,V) = x @ W^T, the head's product. for_loss (the cross-entropy their only reader): in bf16
        where the GEMM backend writes its output so and both products of the loss's gradient read its tiled copy
        (half the bytes written, and each of the loss's two passes reads half); else, and for the host, fp32.
        xent_forward and xent_backward read them as they were written."""
        V = self.cfg.vocab_size
        half = (for_loss and "xent_forward_wg_h" in self.k and self._gradient_tiled(N)
                and self.gemm.matmul_half(N, V, C, x, W, logits, tb=1))
        if not half:
            self.gemm.matmul(N, V, C, x, W, logits, tb=1)
        self._half_logits = logits.int_ptr if half else None

    def _gradient_tiled(self, N) -> bool:
        """Whether both products on the logits' gradient run on wgmma (xent_backward writes their tiled copy)."""
        V, C = self.cfg.vocab_size, self.cfg.n_embd
        return self.gemm.on_wgmma(N, C, V) and self.gemm.on_wgmma(V, C, N)

    def _logit_form(self, logits) -> str:
        """The kernels' suffix for how logits were last written: "_h" bf16 (logits), "" fp32."""
        return "_h" if self._half_logits == logits.int_ptr else ""

    def xent_forward(self, N, logits, targets, mask, losses, lse, dlogits, smoothed=False):
        """losses (N), lse (N); on CPUs (xent_fused) also mask * (softmax - onehot) into dlogits. smoothed: with
        the label smoothing this Ops was made with (none: plain), for the loss and the gradient alike."""
        sfx = self._xent_suffix(smoothed)
        if self.caps.xent_fused:
            self.launcher.runp("xent_fused" + sfx, (N,), i32(N), logits, targets, mask, losses, lse, dlogits)
            return
        if self.f.rows:
            self.launcher.run("xent_forward_wg" + self._logit_form(logits) + sfx, (N * self.f.rows,), i32(N), logits,
                              targets, mask, losses, lse, lsize=(self.f.rows,))
            return
        self.launcher.runp("xent_forward" + sfx, (N,), i32(N), logits, targets, mask, losses, lse)

    def xent_backward(self, N, s, logits, targets, mask, lse, dlogits, smoothed=False) -> float:
        """dlogits = s * mask * (softmax - onehot) (smoothed: the smoothed target, as xent_forward's), or, after
        the fused forward, leaves dlogits unscaled; -> the factor the caller's matmuls on dlogits take as alpha (s,
        or 1)."""
        if self.caps.xent_fused:  # the forward left the unscaled gradient in dlogits
            return s
        V, sfx, form = self.cfg.vocab_size, self._xent_suffix(smoothed), self._logit_form(logits)
        if self.copies.book.is_reusing(dlogits) and self._gradient_tiled(N):
            # both products on dlogits read its tiled bf16 copy: write that instead of the fp32 gradient
            Rp, Cp = ceil_to(N, 64), ceil_to(V, 64)
            out = self.launcher.slot(2, Rp * Cp * 2)
            self.launcher.launch(self.k["xent_backward_tiled" + form + sfx], (Cp // 8, Rp), (4, 32),
                         (i32(N), f32(s), logits, targets, mask, lse, out))
            self.copies.book.keep((dlogits.int_ptr, N, V), (out, Rp, Cp))
            return 1.0
        if form:
            raise ClgptError("xent_backward: bf16 logits (head_logits) outside the dlogits reuse block")
        self.launcher.run("xent_backward" + sfx, (ceil_to(V, 64), N), i32(N), f32(s), logits, targets, mask, lse,
                          dlogits, lsize=(64, 1))
        return 1.0

    def embedding_forward(self, N, Tp, tokens, wte, wpe, out):
        """out (N,C) = wte[tokens] + wpe[n % T'] (llama passes a zero position table)."""
        if self.caps.embedding_rows:
            self.launcher.runp("embedding_forward_rows", (N,), i32(N), i32(Tp), tokens, wte, wpe, out)
            return
        self.launcher.runp("embedding_forward", (self.cfg.n_embd, N), i32(N), i32(Tp), tokens, wte, wpe, out)

    def token_embd_backward(self, n_rows, rows, starts, order, dx, dwte):
        """dwte[rows[r]] += sum of dx rows order[starts[r]..starts[r+1]) (host-sorted: deterministic)."""
        self.launcher.runp("embedding_backward_wte", (self.cfg.n_embd, n_rows), i32(n_rows), rows, starts, order, dx, dwte)

    def position_embd_backward(self, Bp, Tp, dx, dwpe):
        self.launcher.runp("embedding_backward_wpe", (self.cfg.n_embd, Tp), i32(Bp), i32(Tp), dx, dwpe)

    def _rope_launch(self, name, slots, N, args):
        """GPUs: (slots * D/2, N) work-items, one per pair; else (slots, N), one per (head slot, row), in
        work-groups of about 64 (PoCL pays per group)."""
        if self.caps.rope_per_pair:
            pairs = slots * self.cfg.head_dim // 2
            self.launcher.run(name + "_el", (ceil_to(pairs, 64), N), *args, lsize=(64, 1))
            return
        r = max(1, 64 // slots)
        self.launcher.run(name, (slots, ceil_to(N, r)), *args, lsize=(slots, r))

    def rope_forward(self, N, Tp, src, cos, sin, qkv):
        """qkv (N,3C) = RoPE'd q, k and v (kv heads repeated) from the q | k | v product src (N, C+2Ckv);
        with n_head_kv == n_head in place (src is qkv)."""
        H, G = self.cfg.n_head, self.cfg.n_head // self.cfg.kv_heads
        self._rope_launch("rope_forward", 2 * H if G == 1 else 3 * H, N, (i32(N), i32(Tp), src, cos, sin, qkv))

    def rope_backward(self, N, Tp, dqkv, cos, sin, dsrc):
        """dsrc (N, C+2Ckv), the q | k | v product's gradient, from dqkv (N,3C); in place when G == 1."""
        H, Hkv = self.cfg.n_head, self.cfg.kv_heads
        self._rope_launch("rope_backward", 2 * H if H == Hkv else H + 2 * Hkv, N,
                          (i32(N), i32(Tp), dqkv, cos, sin, dsrc))

    def swiglu_rows_forward(self, N, h, out, products_only=False):
        """out (N,F) = silu(h[:, :F]) * h[:, F:], h (N,2F) = gate | up. products_only: the caller's products
        (down's forward and weight gradient) are out's only readers; where out is stable and both run on wgmma,
        only out's kept tiled copy is written then, as gpt2's gelu(h) (WgmmaGemm.matmul_epi)."""
        F = self.cfg.n_ff
        if self.caps.swiglu_per_element and F % 4 == 0:  # GPUs: 4 outputs a work-item, out's tiled copy where kept
            kname, copy = self.copies.with_copy("swiglu_rows_forward_v4", out, N, F)
            if products_only and copy and self.gemm.on_wgmma(N, self.cfg.n_embd, F) and self.gemm.on_wgmma(self.cfg.n_embd, F, N):
                kname += "_only"
            self.launcher.run(kname, (ceil_to(F // 4, 64), ceil_to(N, 4)), i32(N), h, out, *copy, lsize=(64, 4))
            return
        if self.caps.swiglu_per_element:  # other widths: one work-item per output
            self.launcher.run("swiglu_rows_forward_el", (ceil_to(F, 64), N), i32(N), h, out, lsize=(64, 1))
            return
        self.launcher.rows("swiglu_rows_forward", N, (i32(N), h, out))

    def swiglu_forward(self, n, gate, up, out):
        self.launcher.run("swiglu_forward", (ceil_to(n, 256),), i32(n), gate, up, out, lsize=(256,))

    def swiglu_backward(self, n, dy, gate, up, dgate, dup):
        self.launcher.run("swiglu_backward", (ceil_to(n, 256),), i32(n), dy, gate, up, dgate, dup, lsize=(256,))

    def dropout_forward(self, n, seed, site, p, x, out):
        """out = x * keep / (1 - p) over n elements (out may be x)."""
        self.launcher.runp("dropout_forward", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), x, out)

    def dropout_residual(self, n, seed, site, p, resid, y, out):
        """out = resid + y * keep / (1 - p) (a residual branch; out may be resid)."""
        self.launcher.runp("dropout_residual", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), resid, y, out)

    def dropout_backward(self, n, seed, site, p, dx, out=None):
        """out = dx * keep / (1 - p) (out defaults to dx: in place)."""
        self.launcher.runp("dropout_backward", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), dx,
                  dx if out is None else out)

    def grad_norm(self, n, chunk, n_parts, flat_g, partials, clip, norm_buf):
        """norm_buf[0] = ||flat_g||, norm_buf[1] = the clip factor (clip <= 0: 1)."""
        if self.caps.grad_norm_groups:  # GPUs: n_parts work-groups
            LW = self.f.rows
            self.launcher.run("grad_norm_partial_wg", (n_parts * LW,), i32(n), flat_g, partials, lsize=(LW,))
            self.launcher.run("grad_norm_final_wg", (LW,), i32(n_parts), f32(clip), partials, norm_buf, lsize=(LW,))
            return
        self.launcher.run("grad_norm_partial", (n_parts,), i32(n), i32(chunk), flat_g, partials)
        self.launcher.run("grad_norm_final", (1,), i32(n_parts), f32(clip), partials, norm_buf)

    def adamw(self, n, n_decay, p, g, m, v, norm_buf, lr, beta1, beta2, bc1, bc2, eps, weight_decay):
        lsize = (self.launch["local_1d"],)  # lr and the bias corrections change every step: no preset
        name, per = ("adamw_v8", 8) if self.caps.adamw_v8 else ("adamw", 1)  # adamw_v8: 8 parameters a work-item
        self.launcher.launch_plain(self.k[name], (ceil_to(-(-n // per), lsize[0]),), lsize,
                                   (i32(n), i32(n_decay), p, g, m, v, norm_buf, f32(lr), f32(beta1), f32(beta2),
                                    f32(bc1), f32(bc2), f32(eps), f32(weight_decay)))

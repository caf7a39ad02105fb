"""LayerNorm (GPT-2) and RMSNorm (Llama), forward and backward: GPUs a work-group a row and the weight gradients
as two-stage column sums, or with C % 128 == 0 32 work-items a row, the forward also writing its output's tiled
copy where the products read one, the backward dx and each work-group's weight-gradient part in one pass; CPUs a
work-item per RB rows.

Launches kernels/layernorm.cl and kernels/rmsnorm.cl (their _rows kernels share kernels/norm_rows.cl).
"""

from __future__ import annotations

from clgpt.ops.copies import TiledCopies
from clgpt.ops.core import Facts, Part, ceil_to, i32


class Norms(Part):
    """layernorm[_backward], rmsnorm[_backward]; `copies` (the GEMM backend's) gives the kept tiled copy a
    forward writes as it goes."""

    def __init__(self, f: Facts, copies: TiledCopies):
        super().__init__(f)
        self.copies = copies

    def build_gpt2(self):
        """LayerNorm's kernels, with its GPU row forms."""
        f, cfg, dev, k = self.f, self.cfg, self.dev, self.k
        C = cfg.n_embd
        rb, cb = f.norm_rb, f.norm_cb
        for kname in ("layernorm_forward", "layernorm_backward", "layernorm_param_backward"):
            # RB rows / CB channels a work-item only where the table asks (CPUs): other builds keep their bytes
            k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps),
                                  **({"RB": rb} if rb > 1 else {}), **({"CB": cb} if cb > 1 else {}))
        if f.rows:
            for kname in ("layernorm_forward_wg", "layernorm_backward_wg", "layernorm_param_partial",
                          "layernorm_param_final"):
                k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), LW=f.rows, **f.sg)
            if f.ln_rows:  # 32 work-items a row, RW rows a group
                for kname in ("layernorm_forward_rows", "layernorm_backward_rows", "layernorm_param_final_rows"):
                    k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                          **f.row_sg)
                if f.tiled_outputs:  # the output's tiled copy too, and the backward's dx's
                    k["layernorm_forward_rows_tiled"] = dev.kernel("layernorm", "layernorm_forward_rows", C=C,
                                                                   EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                                   LN_TILED=1, **f.row_sg)
                    k["layernorm_backward_rows_tiled"] = dev.kernel("layernorm", "layernorm_backward_rows", C=C,
                                                                    EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                                    DX_TILED=1, **f.row_sg)
                    # and dx's column sums, for the bias gradient the copy's reader takes. A work-item holds 7 x
                    # C / 128 float4s of rows and sums (224 floats at C 1024, near the 255 registers it may have):
                    # the sums' C / 128 more only where C <= 768
                    if f.colsum_copies and C <= 768:
                        k["layernorm_backward_rows_tiled_colsum"] = dev.kernel(
                            "layernorm", "layernorm_backward_rows", C=C, EPS=float(cfg.norm_eps),
                            RW=self.launch["ln_rw"], DX_TILED=1, DX_COLSUM=1, **f.row_sg)

    def build_llama(self):
        """RMSNorm's kernels, with its GPU row forms."""
        f, cfg, dev, k = self.f, self.cfg, self.dev, self.k
        C = cfg.n_embd
        rb, cb = f.norm_rb, f.norm_cb
        for kname in ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_param_backward"):
            # as LayerNorm's: RB rows / CB channels a work-item only where the table asks (CPUs)
            k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps),
                                  **({"RB": rb} if rb > 1 else {}), **({"CB": cb} if cb > 1 else {}))
        if f.ln_rows:  # GPUs, C % 128 == 0: 32 work-items a row, RW rows a group (as LayerNorm's)
            for kname in ("rmsnorm_forward_rows", "rmsnorm_backward_rows", "rmsnorm_param_final_rows"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                      **f.row_sg)
            if f.tiled_outputs:  # the output's tiled copy too, and the backward's dx's
                k["rmsnorm_forward_rows_tiled"] = dev.kernel("rmsnorm", "rmsnorm_forward_rows", C=C,
                                                             EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                             RMS_TILED=1, **f.row_sg)
                k["rmsnorm_backward_rows_tiled"] = dev.kernel("rmsnorm", "rmsnorm_backward_rows", C=C,
                                                              EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                              DX_TILED=1, **f.row_sg)
        elif f.rows:
            for kname in ("rmsnorm_param_partial", "rmsnorm_param_final"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps))
            # one work-group per row (as LayerNorm's): one work-item a row left most of a GPU idle
            for kname in ("rmsnorm_forward_wg", "rmsnorm_backward_wg"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps), LW=f.rows, **f.sg)

    def layernorm(self, N, x, w, b, out, mean, rstd):
        if self.f.ln_rows:  # GPUs, C % 128 == 0: a row a 32-work-item slice, RW a group
            rw = self.launch["ln_rw"]
            kname, copy = self.copies.with_copy("layernorm_forward_rows", out, N, self.cfg.n_embd)
            self.launcher.run(kname, (32, ceil_to(N, rw)), i32(N), x, w, b, out, mean, rstd, *copy, lsize=(32, rw))
            return
        if self.f.rows:
            self.launcher.run("layernorm_forward_wg", (N * self.f.rows,), i32(N), x, w, b, out, mean, rstd, lsize=(self.f.rows,))
            return
        self.launcher.rows("layernorm_forward", -(-N // self.f.norm_rb), (i32(N), x, w, b, out, mean, rstd))

    def layernorm_backward(self, N, dout, x, mean, rstd, w, dw, db, dx, accum, dx_copy=False, dx_colsums=False):
        """dx [+]= LayerNorm's input gradient, dw, db += its weight's and bias's. dx_copy: as rmsnorm_backward's;
        dx_colsums: dx's next reader takes its column sums too (the bias gradient of the linear layer whose output
        gradient dx is): the copy then comes with them (DX_COLSUM), and where they cannot, there is no copy (the
        products' reuse block makes both)."""
        C = self.cfg.n_embd
        sums = dx_colsums and "layernorm_backward_rows_tiled_colsum" in self.k
        if self.f.ln_rows:  # dx and each work-group's dw, db part in one pass, then their sum
            rw, rpi, P = self._row_parts(N)
            xpart = self.launcher.grown("dxparts", P * C) if sums and dx_copy else None
            copy = self.copies.beside(dx, N, C, dx_copy and (sums or not dx_colsums),
                                      colsums=(P, xpart) if xpart is not None else None)
            kname, extra = "layernorm_backward_rows", ()
            if copy is not None:
                kname, extra = (kname + "_tiled_colsum", (copy, xpart)) if sums else (kname + "_tiled", (copy,))
            part = self.launcher.grown("cparts", 2 * P * C)
            self.launcher.run(kname, (32, P * rw), i32(N), i32(rpi), i32(accum), dout, x, w, mean, rstd, dx, part,
                              *extra, lsize=(32, rw))
            self.launcher.run("layernorm_param_final_rows", (C // 2, 32), i32(P), part, dw, db, lsize=(8, 32))
            return
        self.copies.beside(dx, N, C, False)  # dx is written again without a copy
        if self.f.rows:
            self.launcher.run("layernorm_backward_wg", (N * self.f.rows,), i32(N), i32(accum), dout, x, w, mean, rstd, dx,
                     lsize=(self.f.rows,))
            rc = self.launch["colsum_rows"]
            R = -(-N // rc)
            if R < self.launch["colsum_min_parts"]:
                self.launcher.runp("layernorm_param_backward", (-(-C // self.f.norm_cb),), i32(N), dout, x, mean, rstd, dw, db)
                return
            part = self.launcher.grown("cparts", 2 * R * C)
            self.launcher.runp("layernorm_param_partial", (C, R), i32(N), i32(rc), dout, x, mean, rstd, part)
            self.launcher.runp("layernorm_param_final", (C,), i32(R), part, dw, db)
            return
        self.launcher.rows("layernorm_backward", -(-N // self.f.norm_rb), (i32(N), i32(accum), dout, x, w, mean, rstd, dx))
        self.launcher.rows("layernorm_param_backward", -(-C // self.f.norm_cb), (i32(N), dout, x, mean, rstd, dw, db))

    def _row_parts(self, N):
        """The row-slice backward's split of N rows: -> (rows a work-group, rows a row-slot, work-groups: parts)."""
        rw = self.launch["ln_rw"]
        rpi = max(1, N // (rw * self.launch["ln_parts"]))
        return rw, rpi, -(-N // (rw * rpi))

    def rmsnorm(self, N, x, w, out, rstd):
        if self.f.ln_rows:  # GPUs, C % 128 == 0: as LayerNorm's, out's tiled copy written as it goes where kept
            rw = self.launch["ln_rw"]
            kname, copy = self.copies.with_copy("rmsnorm_forward_rows", out, N, self.cfg.n_embd)
            self.launcher.run(kname, (32, ceil_to(N, rw)), i32(N), x, w, out, rstd, *copy, lsize=(32, rw))
            return
        if self.f.rows:
            self.launcher.run("rmsnorm_forward_wg", (N * self.f.rows,), i32(N), x, w, out, rstd, lsize=(self.f.rows,))
            return
        self.launcher.rows("rmsnorm_forward", -(-N // self.f.norm_rb), (i32(N), x, w, out, rstd))

    def rmsnorm_backward(self, N, dout, x, rstd, w, dw, dx, accum, dx_copy=False):
        """dx [+]= RMSNorm's input gradient, dw += its weight's. dx_copy: dx's next readers are the products of a
        linear_backward (dx its dy): on GPUs that read tiled copies, dx's copy is written as dx is (DX_TILED)."""
        C = self.cfg.n_embd
        copy = self.copies.beside(dx, N, C, dx_copy and self.f.ln_rows)
        if self.f.ln_rows:  # dx and each work-group's dw part in one pass, then their sum
            rw, rpi, P = self._row_parts(N)
            part = self.launcher.grown("cparts", P * C)
            self.launcher.run("rmsnorm_backward_rows" + ("_tiled" if copy is not None else ""), (32, P * rw), i32(N),
                              i32(rpi), i32(accum), dout, x, w, rstd, dx, part, *([copy] if copy is not None else []),
                              lsize=(32, rw))
            self.launcher.run("rmsnorm_param_final_rows", (C // 4, 32), i32(P), part, dw, lsize=(8, 32))
            return
        if self.f.rows:
            self.launcher.run("rmsnorm_backward_wg", (N * self.f.rows,), i32(N), i32(accum), dout, x, w, rstd, dx,
                     lsize=(self.f.rows,))
        else:
            self.launcher.rows("rmsnorm_backward", -(-N // self.f.norm_rb), (i32(N), i32(accum), dout, x, w, rstd, dx))
        if self.f.rows:  # GPUs: column sums in two stages over row chunks, as LayerNorm's
            rc = self.launch["colsum_rows"]
            R = -(-N // rc)
            if R >= self.launch["colsum_min_parts"]:
                part = self.launcher.grown("cparts", R * C)
                self.launcher.runp("rmsnorm_param_partial", (C, R), i32(N), i32(rc), dout, x, rstd, part)
                self.launcher.runp("rmsnorm_param_final", (C,), i32(R), part, dw)
                return
        self.launcher.rows("rmsnorm_param_backward", -(-C // self.f.norm_cb), (i32(N), dout, x, rstd, dw))

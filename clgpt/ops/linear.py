"""A linear layer's gradients around the GEMM: linear_backward (the weight's and the input's products, one
operand copy of dy serving both) and the bias gradient's column sums, taken from the tiled copy's column sums
where wgmma's copies made them.

Launches kernels/bias.cl (bias_backward, bias_partial, bias_final, bias_backward_v8); the products run on the
GEMM backend it is given (clgpt/ops/gemm/).
"""

from __future__ import annotations

from clgpt.ops.core import Facts, Part, ceil_to, i32


class Linear(Part):
    """linear_backward and bias_backward on the GEMM backend `gemm` (its matmul and its copies' lifetime)."""

    def __init__(self, f: Facts, gemm):
        super().__init__(f)
        self.gemm, self.copies = gemm, gemm.copies
        dev, k, caps = self.dev, self.k, self.caps
        if caps.bias_v8:  # CPUs: float8 column sums (kernels/bias.cl)
            k["bias_backward_v8"] = dev.kernel("bias", "bias_backward_v8")
        if f.rows:
            k["bias_partial"] = dev.kernel("bias", "bias_partial")
            k["bias_final"] = dev.kernel("bias", "bias_final")
        k["bias_backward"] = dev.kernel("bias", "bias_backward")

    def linear_backward(self, N, n_out, n_in, dy, x, W, dW, dx, db=None, epi=0, E=None, ldc=None):
        """Both gradients of y (N, n_out) = x (N, n_in) @ W.T [+ b]: dW += dy.T @ x, db += dy's column sums,
        dx = dy @ W through matmul_epi's epilogue `epi` (E, ldc as there). dy feeds both products, so the
        operand copy made of it for the first serves the second (reuse)."""
        with self.copies.reuse(dy):
            self.gemm.matmul(n_out, n_in, N, dy, x, dW, ta=1, accum=True)
            if db is not None:
                self.bias_backward(N, n_out, dy, db)
            self.gemm.matmul_epi(N, n_in, n_out, dy, W, dx, epi=epi, E=E, ldc=ldc)

    def bias_backward(self, M, N, dy, db):
        """db (N) += column sums of dy (M,N), in a fixed order."""
        sums = self.copies.book.colsums_of((dy.int_ptr, M, N))
        if sums is not None:  # made with dy's tiled copy
            self.bias_final(sums[0], N, sums[1], db)
            return
        self.copies.settle(dy)
        if self.caps.bias_v8:
            self.launcher.run("bias_backward_v8", (-(-N // 8),), i32(M), i32(N), dy, db, lsize=(1,))
            return
        if not self.f.rows:
            self.launcher.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        rc = self.launch["colsum_rows"]
        R = -(-M // rc)
        if R < self.launch["colsum_min_parts"]:
            self.launcher.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        part = self.launcher.grown("cparts", R * N)
        self.launcher.runp("bias_partial", (N, R), i32(M), i32(N), i32(rc), dy, part)
        self.bias_final(R, N, part, db)

    def bias_final(self, R, N, part, db):
        """db (N) += the sums of R rows of parts (bias_partial's, or to_bf16 COLSUM's): kernels/matmul.cl."""
        self.launcher.run("bias_final", (ceil_to(N, 16), 16), i32(R), i32(N), part, db, lsize=(16, 16))

"""Muon's launchers: momentum, the Newton-Schulz orthogonalisation on the device's GEMM, the scaled update.

A part of its own: it takes the ops object it launches through (its device, queue, buffers, `matmul` and
1-D local size) in the constructor; clgpt.models.params.ParamStore drives it. Kernels: kernels/muon.cl.

Newton-Schulz (torch.optim.Muon, Keller Jordan's muon.py), on U (R, C) with (a, b, c) = NS_COEFFS:
    X = U / max(||U||_F, eps), as X^T when R > C (r = min(R, C) rows);  ns_steps times:
    A = X X^T (r, r);  P = a I + b A + c A A;  X = P X   (= a X + (b A + c A A) X, one product fewer)
Where R > C the transposes are the GEMM's operand flags, not copies: A = X^T X, X = X P^T = X P, so X keeps
U's (R, C) layout throughout. A and P come out exactly symmetric (entry (i, j) and (j, i) sum the same products
in the same order), which is why P needs no transpose. The products take the precision path of the ops (bf16
operands where it is bf16).
"""

from __future__ import annotations

import math

import numpy as np

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # torch.optim.Muon's EPS: the norm's floor
i32, f32 = np.int32, np.float32


def lr_scale(rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's lr adjustment by a matrix's shape: original sqrt(max(1, rows / cols)),
    match_rms_adamw 0.2 sqrt(max(rows, cols))."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon:
    """The launchers of one device's Muon steps; scratch grows to the largest matrix seen."""

    def __init__(self, ops):
        self.ops, self.queue, self.local = ops, ops.queue, ops.launch["local_1d"]
        self.k = {name: ops.dev.kernel("muon", name) for name in
                  ("muon_momentum", "muon_sumsq", "muon_inv_norm", "muon_scale", "muon_poly_init", "muon_update")}
        self._bufs = {}

    def _buf(self, key, n):
        b = self._bufs.get(key)
        if b is None or b.size < max(1, n) * 4:
            b = self._bufs[key] = self.ops.buf(n)
        return b

    def _run(self, name, n, *args):
        self.k[name](self.queue, (-(-n // self.local) * self.local,), (self.local,), *args)

    def momentum(self, n, mu, nesterov, grad, buf, u, norm_buf):
        """buf = lerp(buf, g, 1 - mu), u = nesterov ? lerp(g, buf, mu) : buf, g = grad * norm_buf[1]; n floats."""
        self._run("muon_momentum", n, i32(n), f32(mu), i32(bool(nesterov)), grad, buf, u, norm_buf)

    def orthogonalize(self, U, off, rows, cols, ns_steps, eps=NS_EPS, coeffs=NS_COEFFS):
        """NS(U[off : off + rows*cols] as (rows, cols)) -> a buffer holding it as (rows, cols), valid until
        the next call."""
        a, b, c = coeffs
        n = rows * cols
        parts = max(1, min(256, n // 4096))
        chunk = -(-n // parts)
        partials, scale = self._buf("partials", parts), self._buf("scale", 1)
        self.k["muon_sumsq"](self.queue, (parts,), None, i32(n), i32(off), i32(chunk), U, partials)
        self.k["muon_inv_norm"](self.queue, (1,), None, i32(parts), f32(eps), partials, scale)
        X, Xn = self._buf("x0", n), self._buf("x1", n)
        self._run("muon_scale", n, i32(n), i32(off), U, scale, X)
        r = min(rows, cols)
        A, P = self._buf("gram", r * r), self._buf("poly", r * r)
        mm = self.ops.matmul
        tall = rows > cols
        for _ in range(ns_steps):
            if tall:  # X (rows, cols) holds Y^T: A = Y Y^T = X^T X, and Y' = P Y is X' = X P
                mm(r, r, rows, X, X, A, ta=1)
            else:
                mm(r, r, cols, X, X, A, tb=1)
            self._run("muon_poly_init", r * r, i32(r), f32(a), f32(b), A, P)
            mm(r, r, r, A, A, P, accum=True, alpha=c)
            if tall:
                mm(rows, cols, r, X, P, Xn)
            else:
                mm(rows, cols, r, P, X, Xn)
            X, Xn = Xn, X
        return X

    def update(self, n, off, p, o, decay, lr_adj):
        """p[off + j] = p[off + j] * decay - lr_adj * o[j], j < n."""
        self._run("muon_update", n, i32(n), i32(off), p, o, f32(decay), f32(lr_adj))

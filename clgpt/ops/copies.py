"""The tiled bf16 operand copies wgmma reads, and how long one serves: a `stable` buffer's copy until the next
forward (forget_copies), a `reuse` block's buffer's inside its block, a copy its producer wrote (TILED_OUT,
LN_TILED, RMS_TILED, SWIGLU_TILED, OUT_TILED), and a GELU' deferred into a gradient's copy.

Launches kernels/matmul_bf16.cl (to_bf16 TILED, with COLSUM: the column sums bias_backward takes; with GELU_GRAD:
dg * gelu'(E)) and kernels/gelu.cl (gelu_backward, where a deferred GELU' is applied in place).
"""

from __future__ import annotations

from collections import namedtuple
from contextlib import contextmanager

from clgpt.errors import ClgptError
from clgpt.ops.core import ceil_to, i32

# a GELU' deferred into a gradient's copy (Ops._matmul_bf16): the fp32 buffer holding dg, gelu's input E, the
# product's rows and columns, whether the copy holding dg * gelu'(E) was made
_Deferred = namedtuple("_Deferred", "buf E rows cols copied")


class CopyOps:
    """Kept and reused tiled bf16 copies (mixed into clgpt.ops.Ops)."""

    def stable(self, *bufs):
        """Declare fp32 buffers that hold still from a forward to the end of its backward (activations the
        forward writes once, the weights): on wgmma the tiled copy one product makes serves the later ones, until
        forget_copies, which the engine calls as each forward begins."""
        self._stable.update((b.int_ptr, b) for b in bufs)

    def forget_copies(self):
        self._kept.clear()
        self._premade.clear()
        for gelu in list(self._gelu_pending.values()):
            if not gelu.copied:
                self._settle(gelu.buf)
        self._gelu_pending.clear()

    @contextmanager
    def reuse(self, buf):
        """Inside the block, which does not write `buf`, the tiled copy of it made for one product serves the next
        ones (a gradient that feeds both the weight's and the input's product)."""
        if self._reusing is not None:
            raise ClgptError("Ops.reuse blocks do not nest")
        self._reusing = buf.int_ptr
        try:
            yield
        finally:
            self._reusing, self._colsums = None, None
            if self._premade.pop(buf.int_ptr, None) is not None:
                raise ClgptError("internal: a gradient written only as its tiled copy was never read")
            for key in [k for k in self._kept if k[0] == buf.int_ptr]:
                del self._kept[key]
            gelu = self._gelu_pending.get(buf.int_ptr)
            if gelu is not None and not gelu.copied:  # never copied: finish the fp32 gradient
                self._settle(buf)
            self._gelu_pending.pop(buf.int_ptr, None)

    def tiled_copy(self, slot, X, rows, cols):
        """-> (copy, Rp, Cp): the bf16 copy of X (rows x cols, row-major) in matmul_wgmma.cl's tiled layout, padded
        to Rp, Cp (multiples of 64). A stable buffer's copy is made once per forward and kept (its own device
        buffer), the reuse block's buffer's once per block (scratch slot 2); others go to scratch `slot`."""
        key = (X.int_ptr, rows, cols)
        hit = self._kept.get(key)
        if hit is not None:
            return hit
        Rp, Cp = ceil_to(rows, 64), ceil_to(cols, 64)
        if key[0] in self._stable:
            out = self._kept_buf(X, Rp * Cp * 2)
            out = self._kept[key] = (self.to_bf16(None, X, rows, cols, Rp, Cp, tiled=True, out=out), Rp, Cp)
            return out
        pre = self._premade.pop(key[0], None)
        if pre is not None:  # written by the product that made X (TILED_OUT 2), with its column sums
            if key[0] != self._reusing or pre[1:3] != (rows, cols):
                raise ClgptError("internal: a gradient written only as its tiled copy was read otherwise")
            self._colsums = (key, pre[4], pre[3])
            out = self._kept[key] = pre[:3]
            return out
        if key[0] == self._reusing:  # slot 2, with the column sums for bias_backward where the GPU has them
            if not self.colsum_copies:
                out = self._kept[key] = (self.to_bf16(2, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp)
                return out
            out, part = self._b16_slot(2, Rp * Cp * 2), self._grown("cparts", Rp // 64 * cols)
            args = (i32(rows), i32(cols), X, i32(cols), out, i32(Cp), part)
            gelu = self._gelu_pending.get(key[0])
            if gelu is not None and (gelu.rows, gelu.cols, gelu.copied) == (rows, cols, False):  # GELU' on the way
                self._launch(self.k["to_bf16_colsum_gelu"], (Cp // 8, Rp), (4, 64), args + (gelu.E,))
                self._gelu_pending[key[0]] = gelu._replace(copied=True)
            else:
                self._settle(X)
                self._launch(self.k["to_bf16_colsum"], (Cp // 8, Rp), (4, 64), args)
            self._colsums = (key, Rp // 64, part)
            out = self._kept[key] = (out, Rp, Cp)
            return out
        return self.to_bf16(slot, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp

    def _kept_buf(self, X, nbytes, what=None):
        """The device buffer that holds stable buffer X's tiled copy (or another copy made of X, named `what`),
        grown to nbytes."""
        key = X.int_ptr if what is None else (X.int_ptr, what)
        out = self._kept_bufs.get(key)
        if out is None or out.size < nbytes:
            out = self._kept_bufs[key] = self.launcher.bytes_buf(nbytes)
        return out

    def _kept_copy(self, X, rows, cols):
        """Stable X's kept tiled copy (rows, cols multiples of 64) for X's producer to write: kept from now on."""
        copy = self._kept_buf(X, rows * cols * 2)
        self._kept[(X.int_ptr, rows, cols)] = (copy, rows, cols)
        return copy

    def _with_copy(self, kname, X, rows, cols):
        """-> (kernel, extra arguments): kname's _tiled form, writing stable X's kept tiled copy as it writes X
        (LayerNorm's LN_TILED, RMSNorm's RMS_TILED, SwiGLU's SWIGLU_TILED, flash's OUT_TILED), where that form was
        built and rows, cols are multiples of 64; else kname itself."""
        if not self.tiled_outputs or X.int_ptr not in self._stable or rows % 64 or cols % 64:
            return kname, ()
        return kname + "_tiled", (self._kept_copy(X, rows, cols),)

    def _settle(self, X):
        """X's fp32 values made what its readers expect: a deferred GELU' (_matmul_bf16) applied in place."""
        if X.int_ptr in self._premade:
            raise ClgptError("internal: a gradient written only as its tiled copy was read as fp32")
        gelu = self._gelu_pending.pop(X.int_ptr, None)
        if gelu is not None:
            n = gelu.rows * gelu.cols
            self.runp("gelu_backward", (n,), i32(n), X, gelu.E, X)

    def _b16_slot(self, slot, nbytes):
        """Scratch slot `slot`'s bf16 buffer, grown to at least nbytes."""
        return self.launcher.slot(slot, nbytes)

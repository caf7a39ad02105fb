"""The tiled bf16 operand copies wgmma reads, made as clgpt/ops/copybook.py's CopyBook says how long each serves:
a `stable` buffer's copy until the next forward (forget_copies), a `reuse` block's buffer's inside its block, a
copy its producer wrote (TILED_OUT, LN_TILED, RMS_TILED, SWIGLU_TILED, OUT_TILED; the norms' backward's dx
beside its fp32 values, DX_TILED), the weights' copies made together (batch), and a GELU' deferred into a
gradient's copy. Every GEMM backend owns one (clgpt/ops/gemm/): the wgmma backend's makes copies through its
bf16 GEMM's to_bf16; the portable backend's makes plain (row-major) copies for its bf16 storage by the same
book (plain_copy); the others' keep the book of reuse blocks alone.

Launches kernels/matmul_bf16.cl (to_bf16_batch; to_bf16 TILED, with COLSUM: the column sums bias_backward
takes; with GELU_GRAD: dg * gelu'(E)) and kernels/gelu.cl (gelu_backward, where a deferred GELU' is applied in
place).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pyopencl as cl

from clgpt.ops.copybook import CopyBook
from clgpt.ops.core import Facts, Part, ceil_to, i32


class TiledCopies(Part):
    """Kept and reused tiled bf16 copies; the book, self.book, a CopyBook. bf16: the bf16 GEMM whose to_bf16
    makes the copies (None: a backend that reads none)."""

    def __init__(self, f: Facts, bf16=None):
        super().__init__(f)
        self.bf16 = bf16
        # wgmma reads one tiled copy of a matrix for a product and for its transposes (M- / N-major operands):
        # the book of which copies serve which products (clgpt/ops/copybook.py)
        self.book = CopyBook()
        self._batch, self._batch_launch = {}, None  # batch: (handle, rows, cols) -> (copy, Rp, Cp); its launch
        if bf16 is not None and f.colsum_copies:  # reuse copies: bias_partial's sums too
            for name, extra in (("to_bf16_colsum", {}), ("to_bf16_colsum_gelu", dict(GELU_GRAD=1))):
                self.k[name] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, COLSUM=1, **extra,
                                               **f.bf16_options)
            self.k["gelu_backward"] = self.dev.kernel("gelu", "gelu_backward")

    def stable(self, *bufs):
        """Declare fp32 buffers that hold still from a forward to the end of its backward (activations the
        forward writes once, the weights): on wgmma the tiled copy one product makes serves the later ones, until
        forget_copies, which the engine calls as each forward begins."""
        self.book.stable(*bufs)

    def forget_copies(self):
        for gelu in self.book.forget():
            self._gelu_backward(gelu)

    @contextmanager
    def reuse(self, buf):
        """Inside the block, which does not write `buf`, the tiled copy of it made for one product serves the next
        ones (a gradient that feeds both the weight's and the input's product)."""
        self.book.begin_reuse(buf)
        try:
            yield
        finally:
            gelu = self.book.end_reuse(buf)
            if gelu is not None:  # never copied: finish the fp32 gradient
                self._gelu_backward(gelu)

    def tiled_copy(self, slot, X, rows, cols):
        """-> (copy, Rp, Cp): the bf16 copy of X (rows x cols, row-major) in matmul_wgmma.cl's tiled layout, padded
        to Rp, Cp (multiples of 64). A stable buffer's copy is made once per forward and kept (its own device
        buffer), the reuse block's buffer's once per block (scratch slot 2); others go to scratch `slot`."""
        book = self.book
        key = (X.int_ptr, rows, cols)
        hit = book.hit(key)
        if hit is not None:
            return hit
        Rp, Cp = ceil_to(rows, 64), ceil_to(cols, 64)
        if book.is_stable(X):
            if key in self._batch:  # a weight: every weight's copy in one launch, once a forward
                self._make_batch()
                return book.hit(key)
            out = self.kept_buf(X, Rp * Cp * 2)
            return book.keep(key, (self.bf16.to_bf16(None, X, rows, cols, Rp, Cp, tiled=True, out=out), Rp, Cp))
        pre = book.take_premade(key)
        if pre is not None:  # written by the product that made X (TILED_OUT 2), with its column sums
            return pre
        if book.is_reusing(X):  # slot 2, with the column sums for bias_backward where the GPU has them
            beside = book.take_beside(key)
            if beside is not None:  # written by X's producer (no column sums: bias_backward makes its own)
                return beside
            if not self.f.colsum_copies:
                return book.keep(key, (self.bf16.to_bf16(2, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp))
            out, part = self.launcher.slot(2, Rp * Cp * 2), self.launcher.grown("cparts", Rp // 64 * cols)
            args = (i32(rows), i32(cols), X, i32(cols), out, i32(Cp), part)
            gelu = book.deferred(X)
            if gelu is not None and (gelu.rows, gelu.cols, gelu.copied) == (rows, cols, False):  # GELU' on the way
                self.launcher.launch(self.k["to_bf16_colsum_gelu"], (Cp // 8, Rp), (4, 64), args + (gelu.E,))
                book.gelu_copied(X)
            else:
                self.settle(X)
                self.launcher.launch(self.k["to_bf16_colsum"], (Cp // 8, Rp), (4, 64), args)
            book.colsums = (key, Rp // 64, part)
            return book.keep(key, (out, Rp, Cp))
        return self.bf16.to_bf16(slot, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp

    def plain_copy(self, slot, X, rows, cols):
        """-> (copy, Cp): the bf16 copy of X (rows x cols, row-major) as rows of Cp ushorts (cols rounded up to 32,
        rows to 32, zeros past them; the portable GEMM's bf16 storage, made by its to_bf16), kept as tiled_copy keeps
        its copies: a stable buffer's until forget_copies (a device buffer of its own per shape), the reuse block's
        buffer's inside its block (scratch slot 2); others go to scratch `slot`."""
        book = self.book
        key = (X.int_ptr, rows, cols)
        hit = book.hit(key)
        if hit is None:
            Rp, Cp = ceil_to(rows, 32), ceil_to(cols, 32)
            if book.is_stable(X):
                out = self.kept_buf(X, Rp * Cp * 2, what=(rows, cols))
                hit = book.keep(key, (self.bf16.to_bf16(None, X, rows, cols, Rp, Cp, out=out), Rp, Cp))
            elif book.is_reusing(X):
                hit = book.keep(key, (self.bf16.to_bf16(2, X, rows, cols, Rp, Cp), Rp, Cp))
            else:
                hit = (self.bf16.to_bf16(slot, X, rows, cols, Rp, Cp), Rp, Cp)
        return hit[0], hit[2]


    def batch(self, flat, mats):
        """Make the tiled copies of mats, [(X, offset, rows, cols)]: stable matrices X (the weights) at float
        `offset` of the buffer `flat`, together, in one launch (to_bf16_batch) when a product first asks for any of
        them after forget_copies: one launch a forward where each took its own, the same bytes."""
        self._batch, self._batch_launch = {}, None
        if self.bf16 is None or not mats:
            return
        table, copies, first, chunk = [], [], 0, 0  # table: kernels/matmul_bf16.cl to_bf16_batch's rows
        for X, off, rows, cols in mats:
            Rp, Cp = ceil_to(rows, 64), ceil_to(cols, 64)
            table.append((first, off, rows, cols, Rp, Cp, chunk))
            copies.append(((X.int_ptr, rows, cols), chunk, Rp, Cp))
            first, chunk = first + Rp * Cp // 8, chunk + Rp * Cp // 8
        if max(first, chunk, max(m[1] + m[2] * m[3] for m in mats)) >= 2 ** 31:
            return  # past the kernel's int offsets: a launch a matrix, as without a batch
        tbuf = cl.Buffer(self.launcher.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                         hostbuf=np.array(table, np.int32))
        out = self.launcher.bytes_buf(chunk * 16)
        for key, at, Rp, Cp in copies:
            view = out.get_sub_region(at * 16, Rp * Cp * 2) if at else out
            self._batch[key] = (view, Rp, Cp)
        if "to_bf16_batch" not in self.k:
            self.k["to_bf16_batch"] = self.dev.kernel("matmul_bf16", "to_bf16_batch", TILED=1, **self.f.bf16_options)
        lsize = 256
        self._batch_launch = (self.k["to_bf16_batch"], (ceil_to(first, lsize),), (lsize,),
                              (i32(len(table)), i32(first), tbuf, flat, out))

    def _make_batch(self):
        """Every batched matrix's copy (batch), kept until forget_copies."""
        self.launcher.launch(*self._batch_launch)
        for key, entry in self._batch.items():
            self.book.keep(key, entry)

    def beside(self, X, rows, cols, wanted=True, colsums=None):
        """The reuse block's copy (scratch slot 2) for X's producer to write beside X's fp32 values, where wanted,
        the GPU reads tiled copies and rows, cols are multiples of 64: recorded for X's next reuse block, with
        colsums = (parts, buffer) where the producer also writes X's column sums as parts rows of cols floats; else
        None (and any earlier one dropped: X is being written again)."""
        if not wanted or not self.f.tiled_outputs or rows % 64 or cols % 64:
            self.book.beside(X, None)
            return None
        copy = self.launcher.slot(2, rows * cols * 2)
        self.book.beside(X, (copy, rows, cols) + ((colsums,) if colsums is not None else ()))
        return copy

    def kept_buf(self, X, nbytes, what=None):
        """The device buffer that holds stable buffer X's tiled copy (or another copy made of X, named `what`),
        grown to nbytes."""
        bufs = self.book.kept_bufs
        key = X.int_ptr if what is None else (X.int_ptr, what)
        out = bufs.get(key)
        if out is None or out.size < nbytes:
            out = bufs[key] = self.launcher.bytes_buf(nbytes)
        return out

    def kept_copy(self, X, rows, cols):
        """Stable X's kept tiled copy (rows, cols multiples of 64) for X's producer to write: kept from now on."""
        copy = self.kept_buf(X, rows * cols * 2)
        self.book.keep((X.int_ptr, rows, cols), (copy, rows, cols))
        return copy

    def with_copy(self, kname, X, rows, cols):
        """-> (kernel, extra arguments): kname's _tiled form, writing stable X's kept tiled copy as it writes X
        (LayerNorm's LN_TILED, RMSNorm's RMS_TILED, SwiGLU's SWIGLU_TILED, flash's OUT_TILED), where that form was
        built and rows, cols are multiples of 64; else kname itself."""
        if not self.f.tiled_outputs or not self.book.is_stable(X) or rows % 64 or cols % 64:
            return kname, ()
        return kname + "_tiled", (self.kept_copy(X, rows, cols),)

    def settle(self, X):
        """X's fp32 values made what its readers expect: a deferred GELU' (WgmmaGemm.matmul_epi) applied in place."""
        gelu = self.book.settle(X)
        if gelu is not None:
            self._gelu_backward(gelu)

    def _gelu_backward(self, gelu):
        """A deferred GELU' applied to its buffer's fp32 values, in place."""
        n = gelu.rows * gelu.cols
        self.launcher.runp("gelu_backward", (n,), i32(n), gelu.buf, gelu.E, gelu.buf)

"""The copy book: how long each tiled bf16 operand copy wgmma reads serves, as bookkeeping alone.

The copies themselves are made by kernels/matmul_bf16.cl's to_bf16 (TILED, COLSUM, GELU_GRAD) and by the
producers that write them as they go (TILED_OUT, LN_TILED, RMS_TILED, SWIGLU_TILED, OUT_TILED); clgpt/ops/
copies.py launches those. This object decides nothing on a device and launches nothing: it records

    stable      fp32 buffers that hold still from a forward to the end of its backward (activations, weights):
                their copy serves every product until `forget` (the engine calls it as each forward begins)
    reusing     the one buffer of the open `reuse` block: its copy serves the products inside the block
    kept        (buffer, rows, cols) -> (copy, Rp, Cp) while valid, and the device buffers that hold them
    premade     copies a product wrote instead of its fp32 output (TILED_OUT 2 / 3): buffer -> (copy, Rp, Cp,
                column sums, row chunks), taken by that buffer's reuse block, an error if never read
    beside      copies a producer wrote beside its fp32 output, for the reuse block that follows (the norms'
                backward's dx, DX_TILED): buffer -> (copy, Rp, Cp[, (parts, column sums)]), taken by that
                buffer's reuse block (with the column sums LayerNorm's DX_COLSUM wrote), dropped when the buffer is
                written again without one
    gelu        a GELU' deferred from a backward product into its gradient's reuse copy (Deferred)
    colsums     (key, row chunks, buffer): the column sums the reuse copy's kernel also wrote (bias_backward)
"""

from __future__ import annotations

from collections import namedtuple

from clgpt.errors import ClgptError

# a GELU' deferred into a gradient's copy: the fp32 buffer holding dg, gelu's input E, the product's rows and
# columns, whether the copy holding dg * gelu'(E) was made
Deferred = namedtuple("Deferred", "buf E rows cols copied")


class CopyBook:
    """Which tiled copies are valid and for how long (see the module doc). Buffers are anything with `int_ptr`."""

    def __init__(self):
        self.stable_bufs = {}  # handle -> buffer (held, so no handle is reused while kept)
        self.reusing = None  # the reuse block's buffer's handle
        self.kept, self.kept_bufs = {}, {}
        self.premade = {}
        self.beside_copies = {}  # handle -> (copy, Rp, Cp)
        self.gelu = {}  # handle -> Deferred
        self.colsums = None

    # ---- lifetimes ----
    def stable(self, *bufs):
        self.stable_bufs.update((b.int_ptr, b) for b in bufs)

    def is_stable(self, X) -> bool:
        return X.int_ptr in self.stable_bufs

    def forget(self) -> list:
        """A new forward: every kept and premade copy dropped; -> the Deferred GELU's never copied (the caller
        applies them to their buffers' fp32 values)."""
        unsettled = [g for g in self.gelu.values() if not g.copied]
        self.kept.clear()
        self.premade.clear()
        self.beside_copies.clear()
        self.gelu.clear()
        return unsettled

    def begin_reuse(self, buf):
        if self.reusing is not None:
            raise ClgptError("Ops.reuse blocks do not nest")
        self.reusing = buf.int_ptr

    def end_reuse(self, buf):
        """Close buf's reuse block: its copies dropped; -> its Deferred GELU' where never copied (the caller
        applies it to buf's fp32 values), else None. A copy buf's producer wrote that nothing read is an error."""
        h = buf.int_ptr
        self.reusing, self.colsums = None, None
        self.beside_copies.pop(h, None)
        if self.premade.pop(h, None) is not None:
            raise ClgptError("internal: a gradient written only as its tiled copy was never read")
        for key in [k for k in self.kept if k[0] == h]:
            del self.kept[key]
        gelu = self.gelu.pop(h, None)
        return gelu if gelu is not None and not gelu.copied else None

    def is_reusing(self, X) -> bool:
        return X.int_ptr == self.reusing

    # ---- copies ----
    def hit(self, key):
        """(copy, Rp, Cp) of key = (handle, rows, cols) while valid, else None."""
        return self.kept.get(key)

    def keep(self, key, entry):
        self.kept[key] = entry
        return entry

    def premake(self, X, entry):
        """X's product wrote X only as its tiled copy: entry = (copy, Rp, Cp, column sums, row chunks)."""
        self.premade[X.int_ptr] = entry

    def take_premade(self, key):
        """The copy X's producer wrote, for key = (handle, rows, cols) inside X's reuse block, kept from now on
        (with its column sums); None where there is none. Read any other way it is an error."""
        pre = self.premade.pop(key[0], None)
        if pre is None:
            return None
        if key[0] != self.reusing or pre[1:3] != key[1:]:
            raise ClgptError("internal: a gradient written only as its tiled copy was read otherwise")
        self.colsums = (key, pre[4], pre[3])
        return self.keep(key, pre[:3])

    def beside(self, X, entry):
        """X's producer wrote entry = (copy, Rp, Cp[, (parts, column sums)]) beside X's fp32 values (None: it wrote X
        without one)."""
        if entry is None:
            self.beside_copies.pop(X.int_ptr, None)
        else:
            self.beside_copies[X.int_ptr] = entry

    def take_beside(self, key):
        """The copy written beside key = (handle, rows, cols)'s fp32 values, kept from now on inside its reuse
        block (with its column sums, where written); None where there is none (or it has other rows and
        columns)."""
        entry = self.beside_copies.pop(key[0], None)
        if entry is None or entry[1:3] != key[1:] or key[0] != self.reusing:
            return None
        if len(entry) > 3:
            self.colsums = (key, *entry[3])
        return self.keep(key, entry[:3])

    def check_fp32(self, X):
        """X is about to be read as fp32: an error where X was written only as its tiled copy."""
        if X.int_ptr in self.premade:
            raise ClgptError("internal: a gradient written only as its tiled copy was read as fp32")

    # ---- deferred GELU' ----
    def defer_gelu(self, Cm, E, rows, cols):
        self.gelu[Cm.int_ptr] = Deferred(Cm, E, rows, cols, False)

    def deferred(self, X):
        """X's Deferred GELU' (copied or not), else None."""
        return self.gelu.get(X.int_ptr)

    def gelu_copied(self, X):
        """X's reuse copy now holds dg * gelu'(E): the fp32 buffer is read no more."""
        self.gelu[X.int_ptr] = self.gelu[X.int_ptr]._replace(copied=True)

    def settle(self, X):
        """X is read as fp32 from now on: -> its deferred GELU' to apply in place (None: nothing to do)."""
        self.check_fp32(X)
        return self.gelu.pop(X.int_ptr, None)

    def colsums_of(self, key):
        """(row chunks, buffer) of the column sums made with key's reuse copy, else None."""
        return self.colsums[1:] if self.colsums is not None and self.colsums[0] == key else None

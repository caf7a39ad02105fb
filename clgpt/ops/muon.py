"""Muon's launchers: momentum, the Newton-Schulz orthogonalisation on the device's batched GEMM, the scaled update.

A part of its own: it takes the ops object it launches through (its device, launcher, buffers, `bmm` and 1-D local
size) in the constructor; clgpt.models.params.ParamStore drives it. Kernels: kernels/muon.cl.

Newton-Schulz (torch.optim.Muon, Keller Jordan's muon.py), on U (R, C) with (a, b, c) = NS_COEFFS:
    X = U / max(||U||_F, eps), as X^T when R > C (r = min(R, C) rows);  ns_steps times:
    A = X X^T (r, r);  P = a I + b A + c A A;  X = P X   (= a X + (b A + c A A) X, one product fewer)
Where R > C the transposes are the GEMM's operand flags, not copies: A = X^T X, X = X P^T = X P, so X keeps
U's (R, C) layout throughout. A and P come out exactly symmetric (entry (i, j) and (j, i) sum the same products
in the same order), which is why P needs no transpose.

All the matrices of one shape go together (`orthogonalize` takes their offsets): one norm launch, one copy into
a stack (matrix g at g ld, ld = R C rounded up to the sub-buffer alignment), each product one batched launch over
the stack (ops.bmm), one update; so a step's launches grow with the number of distinct shapes, not of matrices
(a GPU's step was launch-bound per matrix). On that batched (GPU) form a shape's stack is a few matrices, too few
work-groups for a GPU, so: the norm is summed in chunks by hundreds of work-groups (muon_norm_parts) and their
parts again by each work-group of the copy (muon_scale_parts); the Gram product A runs on the tiles on or below
the diagonal alone (causal 1: A is symmetric), its K cut into gram_splits chunks that run as more of the batch;
muon_gram_poly sums the chunks in order into A, mirrored, and P = b A + a I; the A A product adds c A A into P
(accum). Still 2 + 4 ns_steps + 1 launches a shape. The batched products take the precision path of the batched GEMM:
the local-memory kernel (fp32 or tf32/bf16-rounded operands), the mma kernel (on its small tiles) on fp32 operands
rounded to tf32/bf16 where the device has tensor cores, or, where it has the bf16 GEMM (kernels/matmul_bf16.cl)
and the shapes fit its small tiles, that GEMM on stacks kept in bf16: the scaling, muon_gram_poly and each
product but the last write bf16 (P + c A A from the A A product's epilogue), so the products read the operands
the mma kernel would round them to, at half the bytes, through cp.async's pipeline. Same launches, same sums.
Where the device's GEMM is the CPU form (matmul_rb, which has no batched form) the products stay one matrix at a
time through ops.matmul on the stack's sub-buffers: the batched local-memory kernel ran the CPU recipe's Muon
step 10x slower there, and a CPU's launches cost little next to its products.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyopencl as cl

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # torch.optim.Muon's EPS: the norm's floor
NORM_PARTS_MAX = 256  # kernels/muon.cl's muon_norms: work-items a matrix
NORM_LOCAL = 128  # kernels/muon.cl's NORM_LOCAL: work-items a work-group of muon_norm_parts, muon_scale_parts
NORM_CHUNK = 4096  # floats a work-group of muon_norm_parts sums (32 a work-item): a shape's stack, a few hundred
SCALE_PER_ITEM = 4  # entries a work-item of muon_scale_parts scales (each work-group sums the parts first)
GP_TILE = 16  # kernels/muon.cl's GP_TILE: muon_gram_poly's work-groups are GP_TILE x GP_TILE entries
GRAM_SPLIT_MIN_K = 256  # the batched Gram product's K chunks: at least this deep (as MMA_SPLIT_MIN_K)
i32, f32 = np.int32, np.float32


def lr_scale(rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's lr adjustment by a matrix's shape: original sqrt(max(1, rows / cols)),
    match_rms_adamw 0.2 sqrt(max(rows, cols))."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def gram_splits(K: int) -> int:
    """Chunks S the batched Gram product's K is cut into: the most that give equal chunks, each a multiple of 32
    and at least GRAM_SPLIT_MIN_K deep (1: none)."""
    for S in range(K // GRAM_SPLIT_MIN_K, 1, -1):
        if K % S == 0 and (K // S) % 32 == 0:
            return S
    return 1


def norm_parts(n: int) -> int:
    """Work-items summing one matrix of n floats in muon_norms (each a chunk of ceil(n / parts))."""
    return max(1, min(NORM_PARTS_MAX, n // 4096))


class Muon:
    """The launchers of one device's Muon steps; scratch grows to the largest stack seen."""

    def __init__(self, ops):
        self.ops, self.launcher, self.local = ops, ops.launcher, ops.launch["local_1d"]
        self.k = {name: ops.dev.kernel("muon", name) for name in
                  ("muon_momentum", "muon_norms", "muon_scale", "muon_norm_parts", "muon_scale_parts", "muon_poly",
                   "muon_gram_poly", "muon_update")}
        # batched products where the device's GEMM has a batched form: the local-memory kernel, or tensor cores
        self.batched = ops.mm["kernel"] == "matmul" or ops.mma is not None
        # on tensor cores the products take the small tiles: at K = 384 a 128 x 128 tile runs 12 steps of 32 and
        # starves the tensor cores; 64 x 64 gave the H100 2.70 ms of kernels a step against 2.97 (char GPU recipe)
        self.bmm = functools.partial(ops.bmm, small=True) if ops.mma is not None else ops.bmm
        # where the device has the bf16 GEMM (cp.async, NVIDIA sm_80+) the stacks are kept in bf16 and the products
        # run on it (Bf16Gemm.bmm_bf16): the same operands, rounded as the mma kernel rounds them, at half the
        # bytes and with the loads in flight through the whole K
        self.bf16 = ops.gemms.bf16
        self._bufs, self._offs = {}, {}

    @functools.cached_property
    def k16(self) -> dict:
        """The kernels of muon.cl that write bf16 stacks (OUT16), built the first time a shape runs on bf16."""
        return {name: self.ops.dev.kernel("muon", name, OUT16=1) for name in ("muon_scale_parts", "muon_gram_poly")}

    def _buf(self, key, n):
        b = self._bufs.get(key)
        if b is None or b.size < max(1, n) * 4:
            b = self._bufs[key] = self.ops.buf(n)
        return b

    def _table(self, offs) -> cl.Buffer:
        """The device's int32 copy of offsets `offs` (kept: the same few every step)."""
        key = tuple(int(o) for o in offs)
        t = self._offs.get(key)
        if t is None:
            t = self._offs[key] = cl.Buffer(self.ops.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                            hostbuf=np.array(key, np.int32))
        return t

    def _run(self, name, n, *args, count=1):
        """Kernel `name` over n work-items (padded to the 1-D local size) times `count` matrices (through the
        launcher's kept kernels: a step's launches repeat, and only muon_update's scalars follow the schedule)."""
        g = -(-n // self.local) * self.local
        self.launcher.launch(self.k[name], (g, count) if count > 1 else (g,),
                             (self.local, 1) if count > 1 else (self.local,), args)

    def momentum(self, n, mu, nesterov, grad, buf, u, norm_buf):
        """buf = lerp(buf, g, 1 - mu), u = nesterov ? lerp(g, buf, mu) : buf, g = grad * norm_buf[1]; n floats."""
        self._run("muon_momentum", n, i32(n), f32(mu), i32(bool(nesterov)), grad, buf, u, norm_buf)

    def orthogonalized(self, U, shapes, ns_steps, eps=NS_EPS, coeffs=NS_COEFFS):
        """NS of every matrix of `shapes` ({(rows, cols): offsets o in U of the matrices U[o : o + rows*cols]})
        -> yields ((rows, cols), offsets, stack) a shape at a time, the stack holding that shape's matrices
        (matrix g at g * stack_stride(rows, cols)), valid until the next is asked for. The batched form runs the
        shapes' iterations side by side (_iterate_batched); the CPU form one shape after another."""
        if self.batched:
            yield from self._iterate_batched(U, shapes, ns_steps, eps, coeffs)
            return
        for (rows, cols), offs in shapes.items():
            n, G = rows * cols, len(offs)
            ld = self.stack_stride(rows, cols)
            X, Xn = self._buf("x0", G * ld), self._buf("x1", G * ld)
            self._scale(U, self._table(offs), n, G, ld, eps, X)
            rr = self._aligned(min(rows, cols) ** 2)  # the stride of the (r, r) stacks A, P
            A, P = self._buf("gram", G * rr), self._buf("poly", G * rr)
            # one matrix after another, each through all its iterations (its operands stay in cache)
            sub = self.launcher.sub
            for g in range(G):
                self._iterate(rows, cols, ns_steps, coeffs, sub(X, g * ld), sub(Xn, g * ld), sub(A, g * rr),
                              sub(P, g * rr))
            yield (rows, cols), offs, (X if ns_steps % 2 == 0 else Xn)  # each iteration writes the other

    def orthogonalize(self, U, offs, rows, cols, ns_steps, eps=NS_EPS, coeffs=NS_COEFFS):
        """NS of the matrices U[o : o + rows*cols] as (rows, cols), o in offs -> their stack (orthogonalized's)."""
        return next(self.orthogonalized(U, {(rows, cols): offs}, ns_steps, eps, coeffs))[2]

    def _scale(self, U, table, n, G, ld, eps, X, out16=False):
        """X (the stack, ld apart) = each matrix of U at `table`'s offsets over its norm (floored at eps); in bf16
        where out16."""
        if self.batched:  # a GPU: the squares summed by hundreds of work-groups, their parts by each scaling one
            parts = -(-n // NORM_CHUNK)
            part = self._buf("norm_parts", G * parts)
            self.launcher.launch(self.k["muon_norm_parts"], (parts * NORM_LOCAL, G), (NORM_LOCAL, 1),
                                 (i32(n), i32(NORM_CHUNK), table, U, part))
            items = -(-n // (SCALE_PER_ITEM * NORM_LOCAL)) * NORM_LOCAL
            self.launcher.launch((self.k16 if out16 else self.k)["muon_scale_parts"], (items, G), (NORM_LOCAL, 1),
                                 (i32(n), i32(ld), i32(parts), f32(eps), table, U, part, X))
            return
        # the CPU form: a work-group a matrix, its chunks summed in order (PoCL runs the loops vectorised)
        parts = norm_parts(n)
        scale = self._buf("scale", G)
        self.launcher.launch_plain(self.k["muon_norms"], (parts * G,), (parts,),
                                   (i32(n), i32(-(-n // parts)), f32(eps), table, U, scale))
        self._run("muon_scale", n, i32(n), i32(ld), table, U, scale, X, count=G)

    def _iterate(self, rows, cols, ns_steps, coeffs, X, Xn, A, P):
        """The CPU form's ns_steps Newton-Schulz iterations on one matrix X (rows, cols) with A, P (r, r) -> X or
        Xn, whichever holds the result."""
        a, b, c = coeffs
        r = min(rows, cols)
        mm = self.ops.matmul
        for _ in range(ns_steps):
            if rows > cols:  # X (rows, cols) holds Y^T: A = Y Y^T = X^T X, and Y' = P Y is X' = X P
                mm(r, r, rows, X, X, A, ta=1)
            else:
                mm(r, r, cols, X, X, A, tb=1)
            mm(r, r, r, A, A, P, alpha=c)
            self._run("muon_poly", r * r, i32(r * r), i32(r), i32(r * r), f32(a), f32(b), A, P)
            if rows > cols:
                mm(rows, cols, r, X, P, Xn)
            else:
                mm(rows, cols, r, P, X, Xn)
            X, Xn = Xn, X
        return X

    def _iterate_batched(self, U, shapes, ns_steps, eps, coeffs):
        """orthogonalized's batched form. The shapes of one r = min(rows, cols) share A and P stacks (matrix g of
        all theirs at g rr), so an iteration is, for each r: a Gram product a shape, on the tiles on or below the
        diagonal (A is symmetric; causal 1 skips the rest), its K cut into S = gram_splits chunks that run as
        more of the batch (a shape's stack alone leaves most of a GPU idle on a deep K), into S raw parts a
        matrix; one muon_gram_poly over all the r's matrices, summing each one's parts in order, mirrored, into A
        and P = b A + a I; one A A product adding c A A to P (accum); then X' = P X a shape.
        On the bf16 GEMM (_bf16_fits) X, A and P + c A A are kept as bf16 stacks (X16, A16, P16) that the next
        products read, the last X' in fp32: the same roundings as the products' own, so the same sums."""
        a, b, c = coeffs
        by_r, groups = {}, []
        for (rows, cols), offs in shapes.items():
            by_r.setdefault(min(rows, cols), []).append(((rows, cols), offs))
        for r, members in by_r.items():
            rr = self._aligned(r * r)  # the stride of the (r, r) stacks A, P
            gt = sum(len(offs) for _, offs in members)
            smax = max(gram_splits(max(shape)) for shape, _ in members)
            b16 = ns_steps > 0 and self._bf16_fits(r, [shape for shape, _ in members])
            plans, splits, g0 = [], [], 0
            for (rows, cols), offs in members:
                n, G, ld = rows * cols, len(offs), self.stack_stride(rows, cols)
                if b16:  # two bf16 stacks the iterations alternate, and the fp32 one the last writes
                    X, Xn = (self._buf((key, rows, cols), G * ld // 2 + 1) for key in ("x16", "xn16"))
                    out = self._buf(("x0", rows, cols), G * ld)
                else:
                    X, Xn = self._buf(("x0", rows, cols), G * ld), self._buf(("x1", rows, cols), G * ld)
                    out = None
                self._scale(U, self._table(offs), n, G, ld, eps, X, out16=b16)
                S = gram_splits(max(rows, cols))
                splits += [S] * G
                plans.append(dict(shape=(rows, cols), offs=offs, G=G, ld=ld, S=S, g0=g0, X=X, Xn=Xn, out=out))
                g0 += G
            groups.append(dict(r=r, rr=rr, gt=gt, smax=smax, plans=plans, splits=self._table(splits), b16=b16,
                               A=self._buf(("gram16" if b16 else "gram", r), gt * rr),
                               P=self._buf(("poly", r), gt * rr),
                               P16=self._buf(("poly16", r), gt * rr // 2 + 1) if b16 else None,
                               part=self._buf(("gram_parts", r), gt * smax * rr)))
        for it in range(ns_steps):
            last = it == ns_steps - 1
            for q in groups:
                r, rr, smax, A, P, b16 = q["r"], q["rr"], q["smax"], q["A"], q["P"], q["b16"]
                bmm = self.bf16.bmm_bf16 if b16 else self.bmm
                for w in q["plans"]:
                    (rows, cols), G, ld, S, X = w["shape"], w["G"], w["ld"], w["S"], w["X"]
                    tall, kc = rows > cols, max(rows, cols) // S
                    # chunk s of K: rows s kc.. of X where tall (A = X^T X), else its columns s kc.. (A = X X^T)
                    xo = (0, ld, kc * cols if tall else kc)
                    parts = (w["g0"] * smax * rr, smax * rr, rr)  # matrix g's chunk s at (g0 + g) smax rr + s rr
                    bmm(r, r, kc, G * S, S, X, cols, xo, X, cols, xo, q["part"], r, parts, ta=int(tall),
                        tb=int(not tall), causal=1)
                side = -(-r // GP_TILE) * GP_TILE
                self.launcher.launch((self.k16 if b16 else self.k)["muon_gram_poly"], (side, side, q["gt"]),
                                     (GP_TILE, GP_TILE, 1),
                                     (i32(r), i32(rr), i32(smax), q["splits"], f32(a), f32(b), q["part"], A, P))
                # A and P are symmetric, so op(B) = B^T reads them the same, k-contiguous (the GEMMs' faster loads)
                sq = (0, rr, 0)
                if b16:  # P16 = P + c A A, the A A product's epilogue adding P and rounding
                    P = q["P16"]
                    bmm(r, r, r, q["gt"], 1, A, r, sq, A, r, sq, P, r, sq, tb=1, alpha=c, resid=q["P"], out16=True)
                else:
                    bmm(r, r, r, q["gt"], 1, A, r, sq, A, r, sq, P, r, sq, tb=1, alpha=c, accum=True)
                for w in q["plans"]:
                    (rows, cols), G, ld, X, Xn = w["shape"], w["G"], w["ld"], w["X"], w["Xn"]
                    po, xs = (w["g0"] * rr, rr, 0), (0, ld, 0)
                    kw = {}
                    if b16:
                        Xn = w["out"] if last else Xn
                        kw = dict(out16=not last)
                    if rows > cols:
                        bmm(rows, cols, r, G, 1, X, cols, xs, P, cols, po, Xn, cols, xs, tb=1, **kw)
                    else:
                        bmm(rows, cols, r, G, 1, P, r, po, X, cols, xs, Xn, cols, xs, **kw)
                    w["X"], w["Xn"] = Xn, X
        for q in groups:
            for w in q["plans"]:
                yield w["shape"], w["offs"], w["X"]

    def _bf16_fits(self, r, shapes) -> bool:
        """Whether the r group's products (the Gram chunks, A A, P X) all run on the bf16 GEMM's stacks; else the
        batched mma or local-memory kernel."""
        if self.bf16 is None:
            return False
        products = [(r, r, r)]
        for shape in shapes:
            products += [(r, r, max(shape) // gram_splits(max(shape))), (*shape, r)]
        return all(self.bf16.stacks_fit(*p) for p in products)

    def _aligned(self, n) -> int:
        """n rounded up to the sub-buffer alignment (the per-matrix products' sub-buffers start there)."""
        return -(-n // self.ops.align) * self.ops.align

    def stack_stride(self, rows, cols) -> int:
        """Floats from one matrix of the stack orthogonalize returns to the next."""
        return self._aligned(rows * cols)

    def update(self, offs, rows, cols, p, o, decay, lr_adj):
        """p[off + j] = p[off + j] * decay - lr_adj * o[g ld + j] (o: orthogonalize's stack, ld its stride),
        j < rows cols, off = offs[g]."""
        n = rows * cols
        self._run("muon_update", n, i32(n), i32(self.stack_stride(rows, cols)), self._table(offs), p, o, f32(decay),
                  f32(lr_adj), count=len(offs))

"""Mixture of experts: every expert's product in one launch (grouped products), the routing and the routing
weights' gradient.

CPUs run the register-blocked matmul_rb_grouped (the CPU row's RM x NV), GPUs (the local-memory `matmul` form in
their table row) the `matmul` kernel built with GROUP, its tiles chosen as PortableGemm.tiles chooses them for a plain
product of the same size, weight gradients split along K as split_plan splits them. With tensor cores and bf16
operands (every dense product then runs on them too) matmul_mma built with GROUP instead, its tiles and split-K
chosen as MmaGemm.matmul_epi chooses them: the experts' products in the dense products' precision, not fp32. Where the
dense products run on wgmma, so do the grouped ones whose widths are multiples of 64 (matmul_wgmma with GROUP, on
the tiled bf16 copies of the packed rows and of the stacked weights, which are kept as the dense ones are).

Launches kernels/matmul.cl (matmul and matmul_rb_grouped with GROUP, splitk_reduce_grouped), kernels/matmul_mma.cl
(matmul_mma with GROUP), kernels/matmul_wgmma.cl (with GROUP) and kernels/moe.cl (moe_route_packed[_wg],
moe_weight_backward[_wg]); the rest of moe.cl the architecture launches through run. The products' forms
come from the GEMM backends it is given (clgpt/ops/gemm/).
"""

from __future__ import annotations

import math

from clgpt.errors import ClgptError
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32
from clgpt.ops.gemm import Gemms, matmul_defines, matmul_launch, split_k_chunks
from clgpt.ops.layers import Layers
from clgpt.ops.linear import Linear
from clgpt.device.precision import mma_bk, mma_groups, mma_launch
from clgpt.device.tuning import (MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SPLIT_MIN_TOTAL_K, WGMMA_SPLIT_GROUPS,
                                 WGMMA_SPLIT_MIN_K)


class Grouped(Part):
    """Grouped products and MoE routing: `gemms` the backends whose forms they build (the chosen one's matmul for
    the router on CPUs, its copies' lifetime), `linear` the router's gradients, `layers` the experts' SwiGLU."""

    def __init__(self, f: Facts, gemms: Gemms, linear: Linear, layers: Layers):
        super().__init__(f)
        self.gemm, self.copies = gemms.chosen, gemms.chosen.copies
        self.tiled, self.rb, self.mma_gemm, self.wgmma_gemm = gemms.tiled, gemms.rb, gemms.mma, gemms.wgmma
        self.linear, self.layers = linear, layers
        self.route_lw, self.router_rw = 0, 4  # moe_route_packed_wg's work-group (0: none); tokens a router group

    def build(self):
        """kernels/moe.cl: routing, gather, combine and their gradients, rows aligned to grouped_tiles' RM. GPUs
        route in one work-group (its local counts: 2 LW E words) and take dw one work-group a row."""
        cfg, dev, k = self.cfg, self.dev, self.k
        moe = dict(E=cfg.n_expert, K=cfg.n_expert_used, C=cfg.n_embd, RM=self.grouped_tiles()["RM"])
        for kname in ("moe_router_forward", "moe_route_packed", "moe_gather_packed", "moe_combine_forward",
                      "moe_combine_backward", "moe_weight_backward", "moe_router_backward", "moe_scatter_backward"):
            k[kname] = dev.kernel("moe", kname, **moe)
        self.route_lw = 0
        if self.caps.moe_route_group:
            lw = min(256, dev.device.max_work_group_size)
            while lw > 1 and lw * moe["E"] > 4096:
                lw //= 2
            if lw >= moe["E"]:
                self.route_lw = lw
                k["moe_route_packed_wg"] = dev.kernel("moe", "moe_route_packed_wg", **moe, LW=lw)
        if self.f.tiled_outputs:  # the operands of the grouped products straight to their tiled copies
            for kname in ("moe_gather_packed_tiled", "moe_combine_backward_tiled"):
                k[kname] = dev.kernel("moe", kname, **moe, MOE_TILED=1)
            k["swiglu_rows_forward_tiled"] = dev.kernel("swiglu", "swiglu_rows_forward_tiled", EXPERTS_TILED=1)
            k["to_bf16_pair"] = dev.kernel("matmul_bf16", "to_bf16_pair", TILED=1, **self.f.bf16_options)
        self.router_rw = 4  # tokens a work-group of moe_router_forward_rows
        if self.f.rows:  # the router's products inside its kernels, in fp32 (grouped.py moe_router_forward)
            for kname in ("moe_router_forward_rows", "moe_router_dw_partial", "moe_scatter_router_backward"):
                k[kname] = dev.kernel("moe", kname, **moe, RW=self.router_rw)
        if self.caps.moe_weight_backward_groups:
            k["moe_weight_backward_wg"] = dev.kernel("moe", "moe_weight_backward_wg", **moe, LW=64, **self.f.sg)

    def grouped_local(self) -> bool:
        """Whether the grouped products run the local-memory tiled form (GPU rows of the tuning table)."""
        return self.f.mm["kernel"] == "matmul"

    def grouped_mma(self) -> bool:
        """Whether the grouped products run on the tensor cores (matmul_mma with GROUP): bf16 operands on a
        device whose GEMM backend is mma, bf16 or wgmma (all of which keep the mma tiles, self.f.mma)."""
        return self.f.mma is not None and self.f.round == 1

    def grouped_tiles(self) -> dict:
        """RM: the rows every expert's packed rows are aligned to (kernels/moe.cl): the register-blocked form's
        rows per work-item (the CPU row's, else 6 x 16 columns), the tiled form's largest TSM, or on the tensor
        cores the big and small tiles' BM's least common multiple (so every tile size the products pick divides
        it)."""
        if self.grouped_mma():
            return dict(RM=math.lcm(*(mm["BM"] for mm in (*self.f.mma, *(self.f.wgmma or ())))))
        if self.grouped_local():
            tiles = [self.launch.get(k) for k in ("matmul", "matmul_small", "matmul_narrow")]
            return dict(RM=max(t["TSM"] for t in tiles if t is not None and t["kernel"] == "matmul"))
        if self.f.mm["kernel"] == "matmul_rb":
            return dict(RM=self.f.mm["RM"], NV=self.f.mm["NV"], VW=self.f.mm.get("VW", 8), lsize=tuple(self.f.mm.get("lsize", (1, 4))))
        return dict(RM=6, NV=2, VW=8, lsize=(1, 16))

    def grouped_on_wgmma(self, rows, N, K, packed) -> bool:
        """Whether a grouped product of `rows` packed rows, N columns and depth K runs on wgmma: the dense products
        do at its size, `packed` (the rows the packed operands hold) is known, and N, K are multiples of 64 (each
        group's block of a stacked weight starts on a tile)."""
        return (self.grouped_mma() and self.f.wgmma is not None and packed is not None and N % 64 == 0
                and K % 64 == 0 and self.gemm.on_wgmma(rows, N, K))

    def _grouped_kernel(self, group, E, ta, accum):
        g = self.grouped_tiles()
        return self.dev.kernel("matmul", "matmul_rb_grouped", GROUP=group, NGROUPS=E, TA=ta, TB=0,
                               ACCUM=int(accum), RM=g["RM"], NV=g["NV"], VW=g["VW"]), g

    def _grouped_kernel_local(self, mm, group, E, ta, tb, accum, split=0):
        key = ("grouped", group, E, ta, tb, accum, split, id(mm))
        kern = self.product_kernels.get(key)
        if kern is None:
            kern = self.product_kernels[key] = self.dev.kernel("matmul", "matmul", GROUP=group, NGROUPS=E, TA=ta, TB=tb,
                                                   ACCUM=int(accum), SPLITK=split, **matmul_defines(mm))
        return kern

    def matmul_grouped_rows(self, E, max_tiles, N, K, A, lda, B, ldb, bstride, Cm, ldc, counts, offs, tiles,
                            accum=False, alpha=1.0, tb=0, packed=None):
        """For each group e: Cm[rows of e] (,N) = alpha A[rows of e] (,K) @ op(B_e) [+ Cm], B_e = B + e*bstride
        with rows ldb apart (tb: B_e is (N,K), e.g. a slice of a stacked (E, N, K) weight, used transposed);
        group e's rows are offs[e] .. offs[e]+counts[e]-1 (device buffers), max_tiles * RM rows in all, of which
        A and Cm hold `packed` (when given)."""
        if (self.grouped_on_wgmma(max_tiles * self.grouped_tiles()["RM"], N, K, packed) and lda == K and ldc == N
                and ldb == (K if tb else N) and bstride == N * K):
            self._grouped_rows_wgmma(E, packed, N, K, A, B, Cm, counts, offs, accum, alpha, tb)
            return
        if self.grouped_mma():
            rows = max_tiles * self.grouped_tiles()["RM"]
            mm = self.mma_gemm.tiles(rows, N)
            align4 = lda % 4 == 0 and ldb % 4 == 0 and bstride % 4 == 0
            kern = self.mma_gemm.kernel(mm, 0, tb, False, False, bool(accum), 0, align4, group=1, ngroups=E)
            gsize, lsize = mma_launch(mm, rows, N)
            self.launcher.launch(kern, gsize, lsize, (i32(rows), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                                              None, None, f32(alpha), None, i32(0), i32(1), i32(bstride), i32(0),
                                              counts, offs))
            return
        if self.grouped_local():
            rows = max_tiles * self.grouped_tiles()["RM"]
            mm, _ = self.tiled.tiles(rows, N)
            kern = self._grouped_kernel_local(mm, 1, E, 0, tb, accum)
            gsize, lsize = matmul_launch(mm, rows, N)
            self.launcher.launch(kern, gsize, lsize, (i32(rows), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                                              None, None, f32(alpha), None, i32(0), i32(1), i32(bstride), i32(0),
                                              counts, offs))
            return
        if tb:  # the register-blocked form reads op(B) rows: stacked (E*N, K) -> (K, E*N), B_e at column e*N
            if ldb != K or bstride != N * K:
                raise ClgptError(f"matmul_grouped_rows: tb needs a contiguous stacked (E, N, K) B "
                                 f"(ldb {ldb}, bstride {bstride}, N {N}, K {K})")
            B, ldb = self.transposed_b(B, E * N, K)
            bstride = N
        kern, g = self._grouped_kernel(1, E, 0, accum)
        ls = g["lsize"]
        gsize = (ceil_to(max_tiles, ls[0]), ceil_to(-(-N // (g["VW"] * g["NV"])), ls[1]))
        self.launcher.launch(kern, gsize, ls, (i32(0), i32(N), i32(K), A, i32(lda), B, i32(ldb), i32(bstride), Cm, i32(ldc),
                                       i32(0), f32(alpha), counts, offs, tiles))

    def matmul_grouped_k(self, E, M, N, A, lda, B, ldb, Cm, ldc, cstride, counts, offs, ta=1, accum=True,
                         alpha=1.0, max_rows=None, total_rows=None, packed=None):
        """For each group e: C_e (M,N) = alpha op(A_e) @ B_e [+ C_e], C_e = Cm + e*cstride, the K = counts[e]
        rows of A_e, B_e from offs[e] (weight gradients: op(A) = dY.T, TA=1). The tiled form splits K where
        split_plan would split a product of total_rows / E rows; chunks cover max_rows (the most one group
        can hold), and those past a group's count do nothing. On the tensor cores (grouped_mma) the same, with
        MmaGemm.matmul_epi's thresholds for E outputs of (M,N); on wgmma (A and B hold `packed` rows) wgmma's."""
        if (ta and max_rows is not None and self.grouped_on_wgmma(packed or 0, N, M, packed) and lda == M
                and ldb == N and ldc == N and cstride == M * N):
            self._grouped_k_wgmma(E, M, N, A, B, Cm, counts, offs, accum, alpha, max_rows, total_rows, packed)
            return
        if self.grouped_mma():
            self._grouped_k_mma(E, M, N, A, lda, B, ldb, Cm, ldc, cstride, counts, offs, ta, accum, alpha,
                                max_rows, total_rows)
            return
        if self.grouped_local():
            if max_rows is None:
                raise ClgptError("matmul_grouped_k: the tiled form needs max_rows (the most rows one group holds)")
            kavg = -(-(total_rows or max_rows * E) // E)
            mm, S, kc = self.tiled.split_plan(M * E, N, kavg)  # the E outputs' tiles as one (E*M, N) output's
            GS = -(-max_rows // kc) if S > 1 else 1
            if GS > 1 and (cstride != M * N or ldc != N):
                GS = 1  # splitk_reduce_grouped wants the E outputs back to back
            if GS == 1:
                kc = 1 << 30  # one chunk: all of a group's rows
            (gx, gy), lsize = matmul_launch(mm, M, N)
            out = self.launcher.grown("parts", GS * E * M * N) if GS > 1 else Cm
            kern = self._grouped_kernel_local(mm, 2, E, ta, 0, accum and GS == 1, split=int(GS > 1))
            self.launcher.launch(kern, (gx, gy, E * GS), lsize + (1,),
                         (i32(M), i32(N), i32(0), A, i32(lda), B, i32(ldb), out, i32(ldc), None, None,
                          f32(1.0 if GS > 1 else alpha), None, i32(kc), i32(GS), i32(0), i32(cstride), counts, offs))
            if GS > 1:
                self._grouped_reduce(E, M * N, kc, accum, alpha, counts, out, Cm)
            return
        kern, g = self._grouped_kernel(2, E, ta, accum)
        ls = g["lsize"]
        gsize = (ceil_to(-(-M // g["RM"]), ls[0]), ceil_to(-(-N // (g["VW"] * g["NV"])), ls[1]), E)
        self.launcher.launch(kern, gsize, ls + (1,), (i32(M), i32(N), i32(0), A, i32(lda), B, i32(ldb), i32(0), Cm, i32(ldc),
                                              i32(cstride), f32(alpha), counts, offs, counts))

    def _grouped_k_mma(self, E, M, N, A, lda, B, ldb, Cm, ldc, cstride, counts, offs, ta, accum, alpha, max_rows,
                       total_rows):
        """matmul_grouped_k on matmul_mma with GROUP 2: the E outputs' work-groups as MmaGemm.matmul_epi counts them; too
        few split each group's rows into chunks of kc (the average group's rows in S chunks of whole mma k-tiles,
        S as MmaGemm.matmul_epi picks it), chunks covering max_rows, their raw sums added by splitk_reduce_grouped."""
        if max_rows is None:
            raise ClgptError("matmul_grouped_k: the tensor-core form needs max_rows (the most rows one group holds)")
        kavg = -(-(total_rows or max_rows * E) // E)
        mm = self.mma_gemm.tiles(M, N, E)
        groups = mma_groups(mm, M, N) * E
        GS, kc = 1, 1 << 30  # one chunk: all of a group's rows
        if kavg >= SPLIT_MIN_TOTAL_K and groups < MMA_SPLIT_GROUPS and cstride == M * N and ldc == N:
            S = min(-(-MMA_SPLIT_GROUPS * 2 // groups), kavg // MMA_SPLIT_MIN_K)  # (reduce wants C_e back to back)
            if S >= 2:
                kc = ceil_to(-(-kavg // S), mma_bk(self.f.round))
                GS = -(-max_rows // kc)
        align4 = lda % 4 == 0 and ldb % 4 == 0
        kern = self.mma_gemm.kernel(mm, ta, 0, False, False, bool(accum) and GS == 1, 0, align4, split=int(GS > 1),
                                group=2, ngroups=E)
        (gx, gy), lsize = mma_launch(mm, M, N)
        out = self.launcher.grown("parts", GS * E * M * N) if GS > 1 else Cm
        self.launcher.launch(kern, (gx, gy, E * GS), lsize + (1,),
                     (i32(M), i32(N), i32(0), A, i32(lda), B, i32(ldb), out, i32(ldc), None, None,
                      f32(1.0 if GS > 1 else alpha), None, i32(kc), i32(GS), i32(0), i32(cstride), counts, offs))
        if GS > 1:
            self._grouped_reduce(E, M * N, kc, accum, alpha, counts, out, Cm)

    def grouped_linear_backward(self, E, max_tiles, N, K, dy, x, w, gw, dx, counts, offs, tiles, max_rows,
                                total_rows, packed=None, accum=False):
        """The backward of y (rows, N) = x (rows, K) @ W_e.T for each group (W stacked (E, N, K)): gw_e (N, K) +=
        dy_e.T @ x_e, then dx (rows, K) = dy @ W_e [+ dx]; one copy of dy serves both products."""
        with self.copies.reuse(dy):
            self.matmul_grouped_k(E, N, K, dy, N, x, K, gw, K, N * K, counts, offs, max_rows=max_rows,
                                  total_rows=total_rows, packed=packed)
            self.matmul_grouped_rows(E, max_tiles, K, N, dy, N, w, K, N * K, dx, K, counts, offs, tiles, accum=accum,
                                     packed=packed)

    def _grouped_rows_wgmma(self, E, R, N, K, A, B, Cm, counts, offs, accum, alpha, tb, a16=None, b16=None,
                            swiglu=None):
        """matmul_grouped_rows on matmul_wgmma with GROUP 1: A's R rows and the stacked weights (E blocks of N
        rows with tb, else of K rows) as tiled copies (a16, b16: made already), each group's rows against its
        block. swiglu = (hgu, copy): Cm is dact, and the epilogue (EPI 3) writes dgate | dup from hgu (R, 2N) only
        as the (R, 2N) tiled copy."""
        mm = self.wgmma_gemm.tiles(N)
        A16, ra, _ = a16 or self.copies.tiled_copy(0, A, R, K)
        B16, rb, cb = b16 or self.copies.tiled_copy(1, B, *((E * N, K) if tb else (E * K, N)))
        epi, ldc, hgu, tail = (3, 2 * N, swiglu[0], (swiglu[1], None)) if swiglu else (0, N, None, ())
        kern = self.wgmma_gemm.kernel(mm, (False, not tb), False, False, bool(accum), epi, tiled_out=epi, group=1,
                                  ngroups=E)
        gn, gm = -(-N // mm["BN"]), -(-R // mm["BM"])
        self.launcher.launch(kern, (gn * 2 * mm["BM"], gm), (2 * mm["BM"], 1),
                     (i32(R), i32(N), i32(ceil_to(K, 64)), A16, i32(ra), i32(ra), B16, i32(rb), i32(rb if tb else cb),
                      Cm, i32(ldc), None, None, f32(alpha), hgu, i32(0), i32(1), i32(N if tb else K), i32(0), counts,
                      offs, *tail))

    def _grouped_k_wgmma(self, E, M, N, A, B, Cm, counts, offs, accum, alpha, max_rows, total_rows, R, a16=None):
        """matmul_grouped_k on matmul_wgmma with GROUP 2: A's and B's R packed rows as tiled copies (a16: A's,
        made already; read with their rows along k); too few work-groups split each group's rows as
        split_k_chunks splits a product of the average group's depth, chunks covering max_rows, their raw sums
        added by splitk_reduce_grouped."""
        mm = self.wgmma_gemm.tiles(N)
        A16, ra, ca = a16 or self.copies.tiled_copy(0, A, R, M)
        B16, rb, cb = self.copies.tiled_copy(1, B, R, N)
        gn, gm = -(-N // mm["BN"]), -(-M // mm["BM"])
        kavg = ceil_to(-(-(total_rows or max_rows * E) // E), 64)
        plan = (split_k_chunks(kavg, gn * gm * E, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K, 64)
                if kavg >= SPLIT_MIN_TOTAL_K else None)
        GS, kc = (-(-max_rows // plan[1]), plan[1]) if plan else (1, 1 << 30)
        kern = self.wgmma_gemm.kernel(mm, (True, True), False, False, bool(accum) and GS == 1, 0, split=int(GS > 1),
                                  group=2, ngroups=E)
        out = self.launcher.grown("parts", GS * E * M * N) if GS > 1 else Cm
        self.launcher.launch(kern, (gn * 2 * mm["BM"], gm, E * GS), (2 * mm["BM"], 1, 1),
                     (i32(M), i32(N), i32(0), A16, i32(ra), i32(ca), B16, i32(rb), i32(cb), out, i32(N), None, None,
                      f32(1.0 if GS > 1 else alpha), None, i32(kc), i32(GS), i32(0), i32(M * N), counts, offs))
        if GS > 1:
            self._grouped_reduce(E, M * N, kc, accum, alpha, counts, out, Cm)

    def _grouped_reduce(self, E, MN, kc, accum, alpha, counts, parts, Cm):
        """C_e (MN) = alpha * the sum of group e's chunks of kc rows in parts [+ C_e] (splitk_reduce_grouped)."""
        red = self.product_kernels.get(("grouped_reduce", E))
        if red is None:
            red = self.product_kernels[("grouped_reduce", E)] = self.dev.kernel("matmul", "splitk_reduce_grouped", GROUP=2,
                                                                   NGROUPS=E)
        lsz = tuple(self.launch["local_2d"])
        self.launcher.launch(red, (ceil_to(MN, lsz[0]), ceil_to(E, lsz[1])), lsz,
                     (i32(MN), i32(kc), i32(bool(accum)), f32(alpha), counts, parts, Cm))

    def transposed_b(self, x, rows, cols):
        """(x (rows, cols) transposed into scratch, its row stride): a B operand for the grouped products,
        rows padded off multiples of 64 floats where the table pads (ld_pad)."""
        pad = self.launch.get("ld_pad", 0)
        ld = rows + pad if pad and rows % 64 == 0 else rows
        return self.rb.transposed(0, x, rows, cols, ld), ld

    def moe_tiled(self, R) -> bool:
        """Whether the experts' operands (R packed rows) are written only as the tiled bf16 copies the grouped
        products read: on wgmma, where every grouped product of this model runs there, widths multiples of 64."""
        C, F = self.cfg.n_embd, self.cfg.n_ff
        return (self.f.tiled_outputs and R % 64 == 0 and C % 64 == 0 and F % 64 == 0
                and self.grouped_on_wgmma(R, F, C, R) and self.grouped_on_wgmma(R, C, F, R))

    def moe_experts_forward(self, E, max_tiles, R, route, xg, w, hgu, act, ye):
        """The experts on their packed rows (route = counts, offs, tiles; w: the stacked gate, up and down
        weights): h = xg @ W_e.T for gate and up, act = silu(gate) * up, ye (R, C) = act @ W_down_e.T. hgu holds
        (R, 2F): gate | up per row with moe_tiled, else gate's (R, F) then up's. With moe_tiled gate and up are one
        product of width 2F, as in the dense feed-forward, against a copy of the two stacked weights with each
        expert's gate and up rows together, and its SwiGLU backward is the epilogue of the down product's input
        gradient (EPI 3)."""
        C, F = self.cfg.n_embd, self.cfg.n_ff
        w_gate, w_up, w_down = w
        if self.moe_tiled(R):
            self._grouped_rows_wgmma(E, R, 2 * F, C, xg, None, hgu, *route[:2], False, 1.0, 1,
                                     b16=self._pair_copy(w_gate, w_up, E, F, C))
            self.launcher.runp("swiglu_rows_forward_tiled", (F // 4, R), i32(R), i32(F), hgu, self.copies.kept_copy(act, R, F))
        else:
            hg, hu = self.launcher.halves(hgu, R * F)
            for W, h in ((w_gate, hg), (w_up, hu)):
                self.matmul_grouped_rows(E, max_tiles, F, C, xg, C, W, C, F * C, h, F, *route, tb=1, packed=R)
            self.layers.swiglu_forward(R * F, hg, hu, act)
        self.matmul_grouped_rows(E, max_tiles, C, F, act, F, w_down, F, C * F, ye, C, *route, tb=1, packed=R)

    def moe_experts_backward(self, E, max_tiles, R, N, route, dye, xg, hgu, act, w, gw, dact, dhgu, dxg):
        """The backward of moe_experts_forward: gw (gate, up, down) += the weight gradients, dxg (R, C) = the
        gradient of xg; dye holds ye's gradient (its tiled copy alone where moe_combine_backward wrote that).
        dact and dhgu (as hgu) are scratch."""
        C, F, K = self.cfg.n_embd, self.cfg.n_ff, self.cfg.n_expert_used
        counts, offs, _ = route
        rows = dict(max_rows=N, total_rows=N * K, packed=R)  # top-k picks distinct experts: at most N rows each
        if not self.moe_tiled(R):
            # ye = act @ Wd_e.T:  dWd_e (C,F) += dye_e.T @ act_e;  dact = dye @ Wd_e
            self.grouped_linear_backward(E, max_tiles, C, F, dye, act, w[2], gw[2], dact, *route, **rows)
            dhg, dhu = self.launcher.halves(dhgu, R * F)
            hg, hu = self.launcher.halves(hgu, R * F)
            self.layers.swiglu_backward(R * F, dact, hg, hu, dhg, dhu)
            # hg = xg @ Wg_e.T, hu = xg @ Wu_e.T:  dW_e (F,C) += dh_e.T @ xg_e;  dxg = dhg @ Wg_e + dhu @ Wu_e
            for j, (dh, W, g) in enumerate(((dhg, w[0], gw[0]), (dhu, w[1], gw[1]))):
                self.grouped_linear_backward(E, max_tiles, F, C, dh, xg, W, g, dxg, *route, **rows, accum=j > 0)
            return
        copy = self.copies.kept_buf(dhgu, R * 2 * F * 2)  # dgate | dup, only as its tiled copy
        with self.copies.reuse(dye):
            self.matmul_grouped_k(E, C, F, dye, C, act, F, gw[2], F, C * F, counts, offs, **rows)
            self._grouped_rows_wgmma(E, R, F, C, dye, w[2], dact, counts, offs, False, 1.0, 0, swiglu=(hgu, copy))
        # gate's and up's weight gradients from the copy's two halves (its 64-column blocks lie one after another),
        # then dxg = dgate | dup @ [Wg_e; Wu_e] in one product of depth 2F
        for g, half in zip(gw[:2], self.launcher.halves(copy, R * F // 2)):  # R x F bf16 each: R F / 2 floats' bytes
            self._grouped_k_wgmma(E, F, C, None, xg, g, counts, offs, True, 1.0, N, N * K, R, a16=(half, R, F))
        self._grouped_rows_wgmma(E, R, C, 2 * F, None, None, dxg, counts, offs, False, 1.0, 0, a16=(copy, R, 2 * F),
                                 b16=self._pair_copy(w[0], w[1], E, F, C))

    def _pair_copy(self, gate, up, E, F, C):
        """The kept tiled copy of the stacked gate and up weights as one (E, 2F, C): expert e's gate rows then its
        up rows (kernels/matmul_bf16.cl to_bf16_pair), made once per forward."""
        key = (gate.int_ptr, "pair")
        hit = self.copies.book.hit(key)
        if hit is None:
            Rp, Cp = 2 * E * F, ceil_to(C, 64)
            out = self.copies.kept_buf(gate, Rp * Cp * 2, "pair")
            self.launcher.launch(self.k["to_bf16_pair"], (Cp // 8, Rp), (4, 32), (i32(F), i32(C), gate, up, out))
            hit = self.copies.book.keep(key, (out, Rp, Cp))
        return hit

    def moe_gather(self, N, R, pos, x, xg):
        """xg (R,C): xg[pos(n,k)] = x[n]; with moe_tiled only as xg's kept tiled copy (xg is stable)."""
        C, NK = self.cfg.n_embd, N * self.cfg.n_expert_used
        if self.moe_tiled(R):
            self.launcher.runp("moe_gather_packed_tiled", (C // 4, NK), i32(N), i32(R), pos, x, self.copies.kept_copy(xg, R, C))
            return
        self.launcher.runp("moe_gather_packed", (C, NK), i32(N), pos, x, xg)

    def moe_combine_backward(self, N, R, dout, w, pos, dye):
        """dye (R,C): dye[pos(n,k)] = w[n,k] dout[n]; with moe_tiled only as its tiled copy, which dye's reuse
        block (grouped_linear_backward) takes."""
        C, NK = self.cfg.n_embd, N * self.cfg.n_expert_used
        if self.moe_tiled(R):
            copy = self.copies.kept_buf(dye, R * C * 2)
            self.launcher.runp("moe_combine_backward_tiled", (C // 4, NK), i32(N), i32(R), dout, w, pos, copy)
            self.copies.book.premake(dye, (copy, R, C, None, 0))
            return
        self.launcher.runp("moe_combine_backward", (C, NK), i32(N), dout, w, pos, dye)

    def moe_router_forward(self, N, fixed, x, wr, rlogits, probs, sel, w):
        """probs (N,E) = softmax(x @ Wr.T), sel (N,K) its top-k (kept with `fixed`), w the renormalised picks. GPUs
        take the logits inside the router's kernel, in fp32 whatever the precision (a product of width E, with its
        operand copies, cost more than the dot products); CPUs through matmul into rlogits."""
        if self.f.rows:
            rw = self.router_rw
            self.launcher.run("moe_router_forward_rows", (32, ceil_to(N, rw)), i32(N), i32(fixed), x, wr, probs, sel, w,
                     lsize=(32, rw))
            return
        self.gemm.matmul(N, self.cfg.n_expert, self.cfg.n_embd, x, wr, rlogits, tb=1)
        self.launcher.runp("moe_router_forward", (N,), i32(N), i32(fixed), rlogits, probs, sel, w)

    def moe_router_backward(self, N, aux_scale, dwsel, acts, x, wr, gwr, drlogits, dxg, dx):
        """The router's backward: drlogits (N,E) from the picks' weight gradients dwsel and the load-balancing
        term (aux_scale; acts: the layer's forward buffers probs, sel, w, counts, pos), gwr (E,C) += drlogits.T @ x, and
        dx (N,C) = drlogits @ Wr plus the sum of each token's rows of dxg (the gather's gradient)."""
        E, C = self.cfg.n_expert, self.cfg.n_embd
        pos = acts["pos"]
        self.launcher.runp("moe_router_backward", (N,), i32(N), f32(aux_scale), dwsel, acts["probs"], acts["sel"],
                  acts["w"], acts["counts"], drlogits)
        if self.f.rows:
            rc = self.launch["colsum_rows"]
            P = -(-N // rc)
            part = self.launcher.grown("cparts", P * E * C)
            self.launcher.runp("moe_router_dw_partial", (C, P), i32(N), i32(rc), drlogits, x, part)
            self.linear.bias_final(P, E * C, part, gwr)
            self.launcher.runp("moe_scatter_router_backward", (C, N), i32(N), pos, dxg, drlogits, wr, dx)
            return
        self.linear.linear_backward(N, E, C, drlogits, x, wr, gwr, dx)
        self.launcher.runp("moe_scatter_backward", (C, N), i32(N), pos, dxg, dx)

    def moe_route(self, N, probs, sel, pos, counts, offs, tiles, pmean):
        """Pack each expert's tokens in increasing order at a tile-aligned offset (kernels/moe.cl)."""
        args = (i32(N), probs, sel, pos, counts, offs, tiles, pmean)
        if self.route_lw:
            self.launcher.run("moe_route_packed_wg", (self.route_lw,), *args, lsize=(self.route_lw,))
        else:
            self.launcher.run("moe_route_packed", (self.cfg.n_expert,), *args, lsize=(1,))

    def moe_weight_backward(self, N, dy, pos, ye, dwsel):
        """dwsel (N, K): the gradient of each pick's weight, dy . ye of its expert's row."""
        if self.caps.moe_weight_backward_groups:
            self.launcher.run("moe_weight_backward_wg", (N * self.cfg.n_expert_used * 64,), i32(N), dy, pos, ye, dwsel,
                     lsize=(64,))
        else:
            self.launcher.runp("moe_weight_backward", (N * self.cfg.n_expert_used,), i32(N), dy, pos, ye, dwsel)

// bf16 GEMM on NVIDIA tensor cores (sm_80+), CUTLASS-style, through inline PTX:
//   Cm (M,N) = alpha * A (M,K) @ B (N,K)^T [+ bias] [+ R] [+ Cm], then EPI (epilogue.cl), fp32 out.
// Operands are bf16 copies (ushort) that `to_bf16` below writes from the engine's fp32 buffers, in the
// layout the fp32 buffer has: A as M x K (AKC=1, k-contiguous rows) or K x M (AKC=0), B as N x K (BKC=1)
// or K x N (BKC=0); M, N padded to the tile (BM, BN) and K to BK = 32 with zeros, so the main loop needs
// no bounds checks; lda, ldb = the copies' row lengths. The copy rounds as precision.cl's bf16_bits does
// (nearest even), so results match the portable ROUND=1 kernel up to the order of fp32 sums.
//
// Work-group: WM x WN warps (1-D local size 32*WM*WN), output tile BM x BN, warp tile (BM/WM) x (BN/WN)
// as MT x NT mma.m16n8k16 tiles with fp32 accumulators in registers. K in tiles of BK = 32 bf16 (64 bytes
// a row), STAGES tiles in flight: cp.async (16 bytes a copy) from global into local memory, one barrier
// a tile; fragments loaded with ldmatrix.x4 (.trans for the m- or n-contiguous forms). k-contiguous
// local rows are 4 chunks of 16 bytes; chunk c of row r is stored at chunk c ^ ((r >> 1) & 3), so the 8
// row addresses of one 8x8 ldmatrix (rows r..r+7, one chunk) fall in 8 distinct 16-byte bank groups (no
// conflicts) and cp.async writes stay 16-byte aligned. m- (n-) contiguous local rows are one k each,
// BM (BN) values: chunk c of row k at chunk c ^ (k & 7) (8 consecutive k rows, one chunk: distinct groups).
// PTX fragments (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4): a0 (g, 2t..2t+1), a1 (g+8, 2t..),
// a2 (g, 2t+8..), a3 (g+8, 2t+8..); b0 (k 2t.., n g), b1 (k 2t+8.., n g); c (g, 2t..2t+1), (g+8, 2t..).
// ldmatrix.x4 gives lane l of matrix q the pair (row l/4, cols 2(l%4)..) of the 8x8 matrix whose row
// addresses lanes 8q..8q+7 supply.
// BATCH (as matmul.cl's, work-group z along dimension 2: A, B, Cm and R moved by o + (z / HB) sb + (z % HB) sh,
// in elements) with CAUSAL 1 (the tiles on or below the diagonal alone); OUT16: Cm is bf16, each output
// alpha acc [+ R] rounded as to_bf16 rounds (N and ldc even): Muon's Newton-Schulz stacks (clgpt/ops/muon.py),
// whose next products read the copy.
// -D: BM BN WM WN STAGES AKC BKC; BIAS RESID ACCUM EPI SPLITK as matmul.cl; MMA_EMULATE (PoCL tests: the same
// data movement with cp.async, ldmatrix and mma.sync done by work-group exchanges, bit-exact sums in
// k order); SMEM_CVTA (1: the local pointer's integer value is a generic address: convert it).
#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef WM
#define WM 2
#endif
#ifndef WN
#define WN 4
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef AKC
#define AKC 1
#endif
#ifndef BKC
#define BKC 1
#endif
#ifndef MMA_EMULATE
#define MMA_EMULATE 0
#endif
#ifndef SMEM_CVTA
#define SMEM_CVTA 0
#endif
#ifndef BATCH
#define BATCH 0
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef OUT16
#define OUT16 0
#endif
#if BATCH
#define BATCH_ARGS , const int HB, const int oA, const int sAb, const int sAh, const int oB, const int sBb, \
    const int sBh, const int oC, const int sCb, const int sCh
#else
#define BATCH_ARGS
#endif
#if OUT16
#define OUT_T ushort
#else
#define OUT_T float
#endif
#include "epilogue.cl"
#include "precision.cl"
#include "mma_bf16.cl"

#define NTH (WM * WN * 32)
#define WTM (BM / WM)  // warp tile rows
#define WTN (BN / WN)  // warp tile columns
#define MT (WTM / 16)
#define NT (WTN / 8)   // even: ldmatrix.x4 loads two n tiles
#define BK 32
#define ROWB 64                         // bytes per staged row (BK bf16)
#define STAGE_BYTES ((BM + BN) * ROWB)  // A rows, then B rows
#define CPT ((BM + BN) * 4 / NTH)       // 16-byte copies per work-item per stage
#define SWZ(r, c) ((r) * ROWB + ((((c) ^ (((r) >> 1) & 3))) << 4))  // k-contiguous rows
#define AMASK (BM >= 64 ? 7 : BM / 8 - 1)
#define BMASK (BN >= 64 ? 7 : BN / 8 - 1)
#define SWZ_MN(k, c, W, MASK) ((k) * (W) * 2 + (((c) ^ ((k) & (MASK))) << 4))  // m/n-contiguous rows, W wide

// ---- fp32 -> bf16 operand copies ----
#ifndef TILED
#define TILED 0
#endif
// TILED 1: the copies in kernels/matmul_wgmma.cl's operand layout instead of row-major (precision.cl
// tiled_chunk). COLSUM 1 (with TILED; work-group (4, 64): 32 columns x 64 rows): also part[(r / 64) K + k] =
// the sums of S's columns over each 64 rows, in row order: bias_partial's sums (kernels/matmul.cl, rc 64) taken
// from the copy's reads, for bias_final.
#ifndef COLSUM
#define COLSUM 0
#endif
#if COLSUM
#define COLSUM_ARGS , __global float* part
#else
#define COLSUM_ARGS
#endif
// GELU_GRAD 1: the copy (and its sums) of S * gelu'(E), E laid out as S: a GELU's gradient finished on the way
// into the copy (Ops: the backward's product dg then gelu', deferred).
#ifndef GELU_GRAD
#define GELU_GRAD 0
#endif
#if GELU_GRAD
#define GELU_ARGS , __global const float* restrict E
#else
#define GELU_ARGS
#endif

// to_bf16: O (Rp x Kp) = bf16(S (R x K), row stride ld), zeros outside; 8 k a work-item; global (Kp/8, Rp).
__kernel void to_bf16(const int R, const int K, __global const float* restrict S, const int ld,
                      __global uint4* O, const int Kp COLSUM_ARGS GELU_ARGS)
{
    const int c = get_global_id(0), r = get_global_id(1);
    const int k = 8 * c;
    float v[8];
    __global const float* p = S + (size_t)r * ld + k;
#pragma unroll
    for (int h = 0; h < 8; h++) v[h] = (r < R && k + h < K) ? p[h] : 0.0f;
#if GELU_GRAD
#pragma unroll
    for (int h = 0; h < 8; h++)
        if (r < R && k + h < K) v[h] *= gelu_df(E[(size_t)r * ld + k + h]);
#endif
    O[TILED ? tiled_chunk(r, k, get_global_size(1)) : ((size_t)r * Kp + k) / 8] = bf16x8(v);
#if COLSUM
    __local float cs[64][33];
    const int lx = get_local_id(0), ly = get_local_id(1), t = ly * 4 + lx;
#pragma unroll
    for (int h = 0; h < 8; h++) cs[ly][8 * lx + h] = v[h];
    barrier(CLK_LOCAL_MEM_FENCE);
    const int col = get_group_id(0) * 32 + t;
    if (t < 32 && col < K) {
        float s = 0.0f;
        for (int i = 0; i < 64; i++) s += cs[i][t];
        part[(size_t)get_group_id(1) * K + col] = s;
    }
#endif
}

#if TILED
// to_bf16_pair: the tiled copy of two stacked (E, F, K) tensors as one (E, 2F, K), expert e's gate rows then its
// up rows (the experts' gate | up product, clgpt/ops/grouped.py), zeros past K; global (Kp/8, 2EF).
__kernel void to_bf16_pair(const int F, const int K, __global const float* restrict gate,
                           __global const float* restrict up, __global uint4* O)
{
    const int c = get_global_id(0), r = get_global_id(1);
    const int k = 8 * c, e = r / (2 * F), j = r % (2 * F);
    __global const float* p = (j < F ? gate + ((size_t)e * F + j) * K : up + ((size_t)e * F + j - F) * K) + k;
    float v[8];
#pragma unroll
    for (int h = 0; h < 8; h++) v[h] = k + h < K ? p[h] : 0.0f;
    O[tiled_chunk(r, k, get_global_size(1))] = bf16x8(v);
}

// to_bf16_batch: the tiled copies of n matrices of one fp32 buffer S in one launch (the weights, once a forward:
// one launch where each matrix took its own), each as to_bf16 TILED makes it, bit for bit. table: n rows of
// (first work-item, S offset in floats, R, K, Rp, Kp, O offset in 16-byte chunks), by first work-item; work-item
// i takes the last row whose first is <= i, then 8 k of one row as to_bf16 does. 1-D launch over the rows' work-
// items (Rp Kp / 8 each, total), padded to the local size.
__kernel void to_bf16_batch(const int n, const int total, __global const int* restrict table,
                            __global const float* restrict S, __global uint4* O)
{
    const int i = get_global_id(0);
    if (i >= total) return;
    int lo = 0, hi = n - 1;  // the row: binary search over the first work-items
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[7 * mid] <= i) lo = mid; else hi = mid - 1;
    }
    __global const int* t = table + 7 * lo;
    const int li = i - t[0], R = t[2], K = t[3], Rp = t[4], kc = t[5] >> 3;
    const int r = li / kc, k = 8 * (li % kc);
    __global const float* p = S + (size_t)t[1] + (size_t)r * K + k;
    float v[8];
#pragma unroll
    for (int h = 0; h < 8; h++) v[h] = (r < R && k + h < K) ? p[h] : 0.0f;
    O[(size_t)t[6] + tiled_chunk(r, k, Rp)] = bf16x8(v);
}
#endif

// ---- PTX (or its emulation) ----
#if !MMA_EMULATE
#define CP_ASYNC(dst, src) \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"((ulong)(src)) : "memory")
#define CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#define LDSM_X4(r0, r1, r2, r3, addr)                                                      \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"          \
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory")
#define LDSM_X4_T(r0, r1, r2, r3, addr)                                                    \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"    \
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory")
#else
// Emulation: local "addresses" are byte offsets into smem; each warp's lanes exchange through xw.
#define CP_ASYNC(dst, src) (*(__local uint4*)((__local uchar*)smem + (dst)) = *(__global const uint4*)(src))
#define CP_COMMIT()
#define CP_WAIT(n)
// lane l of matrix q (rows at lanes 8q..8q+7): row l/4, columns 2(l%4), +1; trans: column l/4 of rows
// 2(l%4), 2(l%4) + 1 (16-bit elements, the lower column or row in the low half)
inline void ldsm_x4(uint* r, const uint addr, __local uint* smem, __local uint* xw, const int lane, const int trans)
{
    __local ushort* h = (__local ushort*)smem;
    xw[lane] = addr;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int q = 0; q < 4; q++) {
        if (!trans) r[q] = smem[(xw[8 * q + lane / 4] + 4 * (lane % 4)) / 4];
        else r[q] = (uint)h[(xw[8 * q + 2 * (lane % 4)] + 2 * (lane / 4)) / 2]
                    | ((uint)h[(xw[8 * q + 2 * (lane % 4) + 1] + 2 * (lane / 4)) / 2] << 16);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#define LDSM_X4_(r0, r1, r2, r3, addr, trans)                    \
    do {                                                         \
        uint r_[4];                                              \
        ldsm_x4(r_, addr, (__local uint*)smem, xw, lane, trans); \
        r0 = r_[0]; r1 = r_[1]; r2 = r_[2]; r3 = r_[3];          \
    } while (0)
#define LDSM_X4(r0, r1, r2, r3, addr) LDSM_X4_(r0, r1, r2, r3, addr, 0)
#define LDSM_X4_T(r0, r1, r2, r3, addr) LDSM_X4_(r0, r1, r2, r3, addr, 1)
#endif

// A stage's copies: chunk e = tid + i * NTH of the stage's 4 BM chunks of A, then 4 BN of B (16 bytes each).
// k-contiguous: chunk c (of 4) of row r (m or n); else chunk c (of BM/8 or BN/8) of k row r.
#define LOAD_STAGE(st, kt)                                                                              \
    {                                                                                                   \
        const int k_ = kbeg + (kt) * BK;                                                                \
        _Pragma("unroll") for (int i = 0; i < CPT; i++) {                                               \
            int e = tid + i * NTH;                                                                      \
            if (e < 4 * BM) {                                                                           \
                if (AKC) CP_ASYNC(sbase + (st) * STAGE_BYTES + SWZ(e >> 2, e & 3),                      \
                                  A + (size_t)(m0 + (e >> 2)) * lda + k_ + 8 * (e & 3));                \
                else CP_ASYNC(sbase + (st) * STAGE_BYTES + SWZ_MN(e / (BM / 8), e % (BM / 8), BM, AMASK), \
                              A + (size_t)(k_ + e / (BM / 8)) * lda + m0 + 8 * (e % (BM / 8)));         \
            } else {                                                                                    \
                e -= 4 * BM;                                                                            \
                if (BKC) CP_ASYNC(sbase + (st) * STAGE_BYTES + BM * ROWB + SWZ(e >> 2, e & 3),          \
                                  B + (size_t)(n0 + (e >> 2)) * ldb + k_ + 8 * (e & 3));                \
                else CP_ASYNC(sbase + (st) * STAGE_BYTES + BM * ROWB + SWZ_MN(e / (BN / 8), e % (BN / 8), BN, BMASK), \
                              B + (size_t)(k_ + e / (BN / 8)) * ldb + n0 + 8 * (e % (BN / 8)));         \
            }                                                                                           \
        }                                                                                               \
    }

__kernel __attribute__((reqd_work_group_size(NTH, 1, 1)))
void matmul_bf16(const int M, const int N, const int Kp,
                 __global const ushort* restrict A, const int lda, __global const ushort* restrict B, const int ldb,
                 __global OUT_T* Cm, const int ldc,
                 __global const float* restrict bias, __global const float* R,
                 const float alpha, __global float* E SPLIT_ARGS BATCH_ARGS)
{
    __local uint4 smem[STAGES * STAGE_BYTES / 16];
#if MMA_EMULATE
    __local uint xbuf[WM * WN * 224];
#endif
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5;
#if MMA_EMULATE
    __local uint* xw = xbuf + warp * 224;
#endif
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane >> 2, t = lane & 3;
    const int2 tile = tile_of_group();
    const int n0 = tile.x * BN, m0 = tile.y * BM;
    int kbeg = 0, kend = Kp;
    SPLIT_RANGE(kbeg, kend, Kp)
#if BATCH
    {
        const int z = get_group_id(2), zb = z / HB, zh = z % HB;
        const size_t oc = oC + (size_t)zb * sCb + (size_t)zh * sCh;
        A += oA + (size_t)zb * sAb + (size_t)zh * sAh;
        B += oB + (size_t)zb * sBb + (size_t)zh * sBh;
        Cm += oc;
#if RESID
        R += oc;
#endif
    }
#endif
#if CAUSAL == 1
    if (n0 > m0 + BM - 1) return;
#endif
    const int nk = (kend - kbeg) / BK;
#if MMA_EMULATE
    const uint sbase = 0;
#elif SMEM_CVTA
    uint sbase;
    {
        ulong s;
        asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"((ulong)smem));
        sbase = (uint)s;
    }
#else
    const uint sbase = (uint)(size_t)smem;
#endif

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) LOAD_STAGE(s, s)
        CP_COMMIT();
    }
    // ldmatrix row addresses (bytes within a stage). k-contiguous: A rows wm*WTM + 16i + (lane % 16), chunk
    // 2kk + lane/16; B rows (n) wn*WTN + 16j + (lane % 8) + 8 (lane / 16), chunk 2kk + (lane / 8) % 2.
    // m/n-contiguous (.trans): matrix q = lane / 8, row r = lane % 8: A k row 16kk + 8(q / 2) + r, m chunk
    // (wm*WTM + 16i + 8(q % 2)) / 8; B k row 16kk + 8(q % 2) + r, n chunk (wn*WTN + 16j + 8(q / 2)) / 8.
    const int arow = wm * WTM + (lane & 15), achunk = lane >> 4;
    const int brow = wn * WTN + (lane & 7) + ((lane >> 4) << 3), bchunk = (lane >> 3) & 1;
    const int q = lane >> 3, r8 = lane & 7;
    for (int kt = 0; kt < nk; kt++) {
        CP_WAIT(STAGES - 2);
        barrier(CLK_LOCAL_MEM_FENCE);  // tile kt is in; every warp is done with tile kt - 1's stage
        {
            const int nt = kt + STAGES - 1;
            if (nt < nk) LOAD_STAGE(nt % STAGES, nt)
            CP_COMMIT();
        }
        const uint st = sbase + (kt % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint a[MT][4], b[NT][2];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                if (AKC) LDSM_X4(a[i][0], a[i][1], a[i][2], a[i][3], st + SWZ(arow + 16 * i, 2 * kk + achunk));
                else LDSM_X4_T(a[i][0], a[i][1], a[i][2], a[i][3],
                               st + SWZ_MN(16 * kk + 8 * (q >> 1) + r8, (wm * WTM + 16 * i) / 8 + (q & 1), BM, AMASK));
            }
#pragma unroll
            for (int j = 0; j < NT / 2; j++) {
                if (BKC) LDSM_X4(b[2 * j][0], b[2 * j][1], b[2 * j + 1][0], b[2 * j + 1][1],
                                 st + BM * ROWB + SWZ(brow + 16 * j, 2 * kk + bchunk));
                else LDSM_X4_T(b[2 * j][0], b[2 * j][1], b[2 * j + 1][0], b[2 * j + 1][1],
                               st + BM * ROWB + SWZ_MN(16 * kk + 8 * (q & 1) + r8, (wn * WTN + 16 * j) / 8 + (q >> 1), BN, BMASK));
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) MMA16816(acc[i][j], a[i], b[j][0], b[j][1]);
        }
    }
    CP_WAIT(0);

    // Outputs: each work-item holds column pairs (2t, 2t+1) of rows g and g + 8 of every 16 x 8 mma tile;
    // with an even ldc (8-byte aligned pairs) they are read and written as float2.
#if !OUT16
    const int pairs = (ldc & 1) == 0;
#endif
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int gn = n0 + wn * WTN + 8 * j + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int gm = m0 + wm * WTM + 16 * i + g + 8 * h;
                if (gm >= M || gn >= N) continue;
                const float2 v = (float2)(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
#if OUT16
                float2 c = alpha * v;
#if RESID
                c += *(__global const float2*)(R + (size_t)gm * ldc + gn);
#endif
                *(__global uint*)(Cm + (size_t)gm * ldc + gn) = bf16x2(c.x, c.y);
#else
                store_pair(v, gm, gn, N, ldc, pairs, Cm, bias, R, E, alpha);
#endif
            }
        }
    }
}

// Probe (bench/gemm_tc.py): does the integer value of a local pointer address ld.shared? out[0] = the
// value, out[1] = what ld.shared read at it (the local array holds 0x5EED0000 + i), out[2] = cvta form's.
__kernel void smem_probe(__global uint* out)
{
    __local uint buf[64];
    const int l = get_local_id(0);
    buf[l] = 0x5EED0000u + l;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) {
#if !MMA_EMULATE
        const uint a = (uint)(size_t)(buf + 3);
        uint v, w;
        ulong s;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
        asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"((ulong)(buf + 3)));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w) : "r"((uint)s) : "memory");
        out[0] = a; out[1] = v; out[2] = w;
#endif
    }
}

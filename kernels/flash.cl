// Causal self-attention as fused kernels (flash attention 2, Dao 2023) on NVIDIA tensor cores, precision bf16:
// the T x T scores never reach memory. Each work-group takes a block of rows of one (batch, head): 128 queries
// as 8 warps of 16 (forward, dq) or 64 keys as 4 warps of 16 (dk/dv, 168 registers: three groups a
// multiprocessor; 8 warps of 16 keys measured the same). It walks the other side's 64-row blocks two stages deep
// in local memory (cp.async: the next block lands while the warps work on this one, one barrier a block).
// Products on mma.sync.m16n8k16 (mma_bf16.cl) with bf16 operands (q, k, v, dout, the probabilities and their
// gradient, rounded to nearest even as precision.cl) and fp32 accumulators; softmax, its statistics and the
// gradients' sums stay fp32. (Measured on the H200: MT 2, 4 warps of 32 query rows that share each B fragment,
// took 254 registers and spilled in the forward, 1.3x the time of MT 1.)
//   flash_bf16          the bf16 copy (rows as the source's) of qkv (B,T,3C) or dout (B,T,C) the others read,
//                       at float COPY_AT(B H, T) of att / datt
//   flash_bf16_rope     flash_bf16 of qkv with llama's RoPE on q and k on the way (see ROPE below)
//   flash_forward       out (B,T,C) from qkv's copy, and lse (B*H*T, the head of att): each row's log2 of its
//                       softmax sum over scores in the log2 domain (s * SCALE * log2 e), the backward's recomputation
//   flash_backward_dq   dq into dqkv (B,T,3C), and delta (B*H*T, the head of datt) = rowsum(dout * out), from
//                       dout's copy
//   flash_backward_dkv  dk, dv into dqkv; reads delta, so it runs after flash_backward_dq
// Row-major (B, T, .) buffers of the batch's T; head h's q, k, v at columns h*D, C + h*D, 2C + h*D.
// Dropout (p > 0) on the probabilities as dropout.cl with element index (z*T + query)*T + key, z = b*H + h:
// the same mask the batched form (attention.cl, att of shape (B,H,T,T)) draws; the row sums use the kept
// probabilities before dropout, the products with v the dropped ones.
// Staged blocks are [row][DP] bf16, rows padded by 8 (16 bytes): the 8 rows of one ldmatrix 8x8 fall in 8
// distinct 16-byte bank groups. B fragments come by ldmatrix.x4 (.trans where the product runs along the staged
// rows: P v, dS k, dS^T q, P^T dout), A fragments of the work-group's own rows straight from the copy. Warps
// whose 16 rows see none of a block's columns (causal) skip its products: they would add exact zeros.
// Work-groups NTQ (256: forward, dq) and NTK (128: dk/dv); global (ceil(T/BR) * NTQ or ceil(T/BRK) * NTK, B*H).
// -D: C H D (head width: a multiple of 16, at most 64), SCALE; SMEM_CVTA (as matmul_bf16.cl); MMA_EMULATE (PoCL
// tests: mma, ldmatrix, cp.async and the quad reductions through local exchanges; every warp runs every block).
// RoPE fused (llama without grouped kv heads, Ops.rope_fused; rope.cl's rope_forward_el / rope_backward_el then
// do not run): flash_bf16_rope rotates q and k (pairs x[2i], x[2i+1] of a head at position t by t theta_i,
// rope_pair.cl; tables cosb, sinb (T_max, D/2)) into the copy the kernels read, and leaves qkv's fp32 q, k as the
// product wrote them. Built with -D ROPE=1 the dq and dk stores rotate back (by -t theta_i: the gradients of the
// unrotated q, k), what rope_backward_el did to dqkv after them; a lane stores a whole pair (columns 8j + 2t,
// +1), so this costs two table reads a pair instead of a pass over dqkv. dv, out and the statistics: no RoPE.
#include "precision.cl"
#include "mma_bf16.cl"
#include "dropout.cl"
#include "rope_pair.cl"

#ifndef ROPE
#define ROPE 0
#endif
#if ROPE
#define ROPE_ARGS , __global const float* restrict cosb, __global const float* restrict sinb
// y (a pair of a head's gradient, pair index pr, at position pos) rotated back: rope_backward_el's operations
#define ROPE_BACK(y, pos, pr) \
    y = rope_pair((y).x, (y).y, cosb[(pos) * (D / 2) + (pr)], -sinb[(pos) * (D / 2) + (pr)])
#else
#define ROPE_ARGS
#define ROPE_BACK(y, pos, pr)
#endif

#ifndef SMEM_CVTA
#define SMEM_CVTA 0
#endif
#define BR 128            // query rows a work-group (forward, dq)
#define BRK 64            // keys a work-group (dk/dv): 4 warps of 16
#define BC 64             // rows a staged block
#ifndef MT
#define MT 1              // forward, dq: 16-row m tiles a warp (BR / 16 / MT warps)
#endif
#define NTQ (BR / 16 / MT * 32)
#ifndef KS
#define KS BC             // forward: keys a softmax step (16, 32 or 64)
#endif
#ifndef KQ
#define KQ 16             // dq: keys a step (16, 32 or 64)
#endif
#ifndef QK
#define QK 16             // dk/dv: queries a step (16, 32 or 64)
#endif
#define NTK (BRK / 16 * 32)
#define DP (D + 8)        // local row of a staged block (bf16)
#define BLK (BC * DP * 2) // bytes of a staged block
#define CH (D / 8)        // 16-byte chunks of a row
#define ND (D / 8)        // n tiles across the head
#define KD (D / 16)       // k steps across the head
#define SL2 (SCALE * 1.4426950408889634f)
// where att (datt) holds the bf16 copy of qkv (dout), in floats: after the (B*H, T) statistics, 256-byte aligned
#define COPY_AT(BH, T) ((((size_t)(BH) * (T)) + 63) & ~(size_t)63)

#if MMA_EMULATE
#define XW_DECL                                  \
    __local uint xbuf[8 * 224];                  \
    __local uint* xw = xbuf + (get_local_id(0) >> 5) * 224;
#define WARP_ACTIVE(c) 1  // emulated exchanges have barriers: every warp takes every block
inline float quad_red(float x, const int mx, __local uint* xw, const int lane)
{
    barrier(CLK_LOCAL_MEM_FENCE);
    xw[lane] = as_uint(x);
    barrier(CLK_LOCAL_MEM_FENCE);
    const int q = lane & ~3;
    const float a = as_float(xw[q]), b = as_float(xw[q + 1]), c = as_float(xw[q + 2]), d = as_float(xw[q + 3]);
    barrier(CLK_LOCAL_MEM_FENCE);
    return mx ? fmax(fmax(a, b), fmax(c, d)) : (a + b) + (c + d);
}
#define QUAD_MAX(x) quad_red(x, 1, xw, lane)
#define QUAD_SUM(x) quad_red(x, 0, xw, lane)
// local "addresses" are byte offsets into smem; cp.async copies at once (n: bytes read, the rest zeros)
#define CP_ASYNC(dst, src, n)                                                                       \
    (*(__local uint4*)((__local uchar*)smem + (dst)) = (n) ? *(__global const uint4*)(src) : (uint4)(0))
#define CP_ASYNC4(dst, src) (*(__local float*)((__local uchar*)smem + (dst)) = *(src))
#define CP_COMMIT()
#define CP_WAIT0()
// lane l of matrix q (rows at lanes 8q..8q+7): row l/4, columns 2(l%4), +1; trans: column l/4 of rows 2(l%4),
// 2(l%4) + 1 (16-bit elements, the lower column or row in the low half), as matmul_bf16.cl's emulation
inline void ldsm_x4(uint* r, const uint addr, __local uint* sm, __local uint* xw, const int lane, const int trans)
{
    __local ushort* h = (__local ushort*)sm;
    xw[lane] = addr;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int q = 0; q < 4; q++) {
        if (!trans) r[q] = sm[(xw[8 * q + lane / 4] + 4 * (lane % 4)) / 4];
        else r[q] = (uint)h[(xw[8 * q + 2 * (lane % 4)] + 2 * (lane / 4)) / 2]
                    | ((uint)h[(xw[8 * q + 2 * (lane % 4) + 1] + 2 * (lane / 4)) / 2] << 16);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#define LDSM(r, addr) ldsm_x4(r, addr, (__local uint*)smem, xw, lane, 0)
#define LDSM_T(r, addr) ldsm_x4(r, addr, (__local uint*)smem, xw, lane, 1)
#else
#define XW_DECL
#define WARP_ACTIVE(c) (c)
inline float shfl_xor(const float x, const int m)
{
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(x), "r"(m));
    return r;
}
// the 4 lanes of a quad (one row of an accumulator) combined as the emulation does: (a + b) + (c + d)
inline float quad_max(float x) { x = fmax(x, shfl_xor(x, 1)); return fmax(x, shfl_xor(x, 2)); }
inline float quad_sum(float x) { x += shfl_xor(x, 1); return x + shfl_xor(x, 2); }
#define QUAD_MAX(x) quad_max(x)
#define QUAD_SUM(x) quad_sum(x)
#define CP_ASYNC(dst, src, n) \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"((ulong)(src)), "r"(n) : "memory")
#define CP_ASYNC4(dst, src) \
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"((ulong)(src)) : "memory")
#define CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_WAIT0() asm volatile("cp.async.wait_group 0;" ::: "memory")
#define LDSM(r, addr)                                                                           \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"               \
                 : "=r"((r)[0]), "=r"((r)[1]), "=r"((r)[2]), "=r"((r)[3]) : "r"(addr) : "memory")
#define LDSM_T(r, addr)                                                                         \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"         \
                 : "=r"((r)[0]), "=r"((r)[1]), "=r"((r)[2]), "=r"((r)[3]) : "r"(addr) : "memory")
#endif

// The local array's address for ldmatrix and cp.async (emulation: byte offsets from 0)
inline uint smem_base(__local const void* p)
{
#if MMA_EMULATE
    return 0;
#elif SMEM_CVTA
    ulong s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"((ulong)p));
    return (uint)s;
#else
    return (uint)(size_t)p;
#endif
}

// ldmatrix.x4 lane offsets (bytes) in a staged block for a 16 x 16 region: LDN_OFF with its rows along n (r[0],
// r[1]: b0, b1 of the region's first n tile, r[2], r[3] of its second), LDT_OFF (.trans) with its rows along k
#define LDN_OFF(lane) ((((lane) & 7) + 8 * ((lane) >> 4)) * DP * 2 + 16 * (((lane) >> 3) & 1))
#define LDT_OFF(lane) ((((lane) & 7) + 8 * (((lane) >> 3) & 1)) * DP * 2 + 16 * ((lane) >> 4))
#define AT(r, c) (((r) * DP + (c)) * 2)  // byte offset of element (r, c) of a staged block

// A fragments (16 rows from r0, all D columns; zeros from row T on) of the bf16 copy src (row stride ld)
inline void load_a(uint a[KD][4], __global const ushort* src, const int ld, const int r0, const int T, const int lane)
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < KD; s++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = r0 + g + 8 * (q & 1), c = 16 * s + 2 * t + 8 * (q >> 1);
            a[s][q] = r < T ? *(__global const uint*)(src + (size_t)r * ld + c) : 0u;
        }
}

// Rows r0..r0+63 of the D columns at src (bf16, row stride ld) into the staged block at local address dst by
// cp.async (nth work-items), zeros from row T on
inline void stage(const uint dst, __global const ushort* src, const int ld, const int r0, const int T,
                  __local uint4* smem, const int nth)
{
    for (int e = get_local_id(0); e < BC * CH; e += nth) {
        const int r = e / CH, c = e % CH, ok = r0 + r < T;
        CP_ASYNC(dst + AT(r, 8 * c), src + (size_t)(ok ? r0 + r : 0) * ld + 8 * c, ok ? 16 : 0);
    }
}

// where a work-item's accumulator c of m tile i, n tile j lies (mma.m16n8's D fragment, g = lane / 4, t = lane % 4):
// row FRAG_ROW(i, c) of the warp's 16i.. rows, column FRAG_COL(j, c) of its 8j.. columns
#define FRAG_ROW(i, c) (16 * (i) + g + 8 * ((c) >> 1))
#define FRAG_COL(j, c) (8 * (j) + 2 * t + ((c) & 1))

// c (16 x 8n accumulators of a warp, from n tile 2j) as the A fragment of one k step of 16
#define AFRAG(a, c, j)                                       \
    {                                                        \
        a[0] = bf16x2(c[2 * (j)][0], c[2 * (j)][1]);         \
        a[1] = bf16x2(c[2 * (j)][2], c[2 * (j)][3]);         \
        a[2] = bf16x2(c[2 * (j) + 1][0], c[2 * (j) + 1][1]); \
        a[3] = bf16x2(c[2 * (j) + 1][2], c[2 * (j) + 1][3]); \
    }
// A warp's products over its M m tiles (16 rows each), every B fragment loaded once for all M:
// PRODUCT_T: c[i][0..2NJ) (16 x 16NJ, zeroed) = a[i] (16 x D, A fragments) @ X^T, X: NJ 16-row groups from row
// x0 of block X; PRODUCT_ACC: acc[i] (16 x D: ND n tiles) += c[i][0..2NK) (16 x 16NK, rounded to bf16 A
// fragments) @ X, X: rows x0.. of block X
#define PRODUCT_T(c, M, NJ, a, X, x0)                                                       \
    _Pragma("unroll") for (int j_ = 0; j_ < (NJ); j_++) {                                   \
        _Pragma("unroll") for (int i_ = 0; i_ < (M); i_++)                                  \
        _Pragma("unroll") for (int c_ = 0; c_ < 4; c_++) c[i_][2 * j_][c_] = c[i_][2 * j_ + 1][c_] = 0.0f; \
        _Pragma("unroll") for (int k_ = 0; k_ < KD; k_++) {                                 \
            uint b_[4];                                                                     \
            LDSM(b_, (X) + AT((x0) + 16 * j_, 16 * k_) + ldn);                              \
            _Pragma("unroll") for (int i_ = 0; i_ < (M); i_++) {                            \
                MMA16816(c[i_][2 * j_], a[i_][k_], b_[0], b_[1]);                           \
                MMA16816(c[i_][2 * j_ + 1], a[i_][k_], b_[2], b_[3]);                       \
            }                                                                               \
        }                                                                                   \
    }
#define PRODUCT_ACC(acc, c, M, NK, X, x0)                                                   \
    _Pragma("unroll") for (int k_ = 0; k_ < (NK); k_++) {                                   \
        uint a_[M][4];                                                                      \
        _Pragma("unroll") for (int i_ = 0; i_ < (M); i_++) AFRAG(a_[i_], c[i_], k_)         \
        _Pragma("unroll") for (int j_ = 0; j_ < KD; j_++) {                                 \
            uint b_[4];                                                                     \
            LDSM_T(b_, (X) + AT((x0) + 16 * k_, 16 * j_) + ldt);                            \
            _Pragma("unroll") for (int i_ = 0; i_ < (M); i_++) {                            \
                MMA16816(acc[i_][2 * j_], a_[i_], b_[0], b_[1]);                            \
                MMA16816(acc[i_][2 * j_ + 1], a_[i_], b_[2], b_[3]);                        \
            }                                                                               \
        }                                                                                   \
    }
// causal and length mask of (key, row), as selects (an element's short-circuit test would branch once an
// element), worked out only on a step that needs it: each kernel tests its warp-uniform `masked` once a step,
// so the steps off the diagonal skip the compares and selects (they were a quarter of the instructions)
#define CAUSAL_OK(key, row) (((key) <= (row)) & ((key) < T))
// 2^x, flushing what would be denormal (x < -126, a probability under 1e-38) to zero: native_exp2 compiles to
// ex2.approx with a fix-up of such inputs around it (a compare and two multiplies an element)
#if MMA_EMULATE
#define EXP2(x) native_exp2(x)
#else
inline float ex2_ftz(const float x)
{
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
#define EXP2(x) ex2_ftz(x)
#endif
// dropout's keep of the probability (query row, key) of head z: the batched form's element (z, row, key)
#define KEEP(row, key) dropout_keep(seed, site, (uint)(((size_t)z * T + (row)) * T + (key)), p)

// qkv (or dout) as its bf16 copy in dst (att or datt) from float COPY_AT(BH, T): n8 groups of 8 floats
__kernel void flash_bf16(const int n8, const int T, const int BH, __global const float* restrict src,
                         __global float* dst)
{
    const int i = get_global_id(0);
    if (i >= n8) return;
    const float8 v = vload8(i, src);
    ((__global uint4*)(dst + COPY_AT(BH, T)))[i] =
        (uint4)(bf16x2(v.s0, v.s1), bf16x2(v.s2, v.s3), bf16x2(v.s4, v.s5), bf16x2(v.s6, v.s7));
}

// qkv (B,T,3C) as flash_bf16 copies it, with q and k rotated first (rope_pair: rope_forward_el's rotation, so
// the copy holds the bf16 rounding of what that kernel would have left in qkv; qkv itself is only read).
// cosb, sinb (T_max, D/2): cos, sin(t theta_i), t = row % T. A work-item's 8 floats are 4 pairs of one head
// (D % 16 == 0: a group never straddles two heads, nor q | k | v).
__kernel void flash_bf16_rope(const int n8, const int T, const int BH, __global const float* restrict src,
                              __global const float* restrict cosb, __global const float* restrict sinb,
                              __global float* dst)
{
    const int i = get_global_id(0);
    if (i >= n8) return;
    float8 v = vload8(i, src);
    const int n = i / (3 * C / 8), col = 8 * (i - n * (3 * C / 8));  // row, column of the group
    if (col < 2 * C) {  // q or k: pairs pr..pr+3 of its head, at position n % T
        const int at = (n % T) * (D / 2) + (col % D) / 2;
        const float4 c = vload4(0, cosb + at), s = vload4(0, sinb + at);
        v = (float8)(rope_pair(v.s0, v.s1, c.s0, s.s0), rope_pair(v.s2, v.s3, c.s1, s.s1),
                     rope_pair(v.s4, v.s5, c.s2, s.s2), rope_pair(v.s6, v.s7, c.s3, s.s3));
    }
    ((__global uint4*)(dst + COPY_AT(BH, T)))[i] =
        (uint4)(bf16x2(v.s0, v.s1), bf16x2(v.s2, v.s3), bf16x2(v.s4, v.s5), bf16x2(v.s6, v.s7));
}

// OUT_TILED 1 (B T and C multiples of 64): also out's bf16 copy in matmul_wgmma.cl's tiled layout (precision.cl
// tiled_chunk, Rp = B T) in out16, the copy the output projection's products read (Ops keeps it).
#ifndef OUT_TILED
#define OUT_TILED 0
#endif
#if OUT_TILED
#define OUT_TILED_ARGS , __global uint* restrict out16
#else
#define OUT_TILED_ARGS
#endif
// DQKV_TILED 1 (B T and C multiples of 64): dq, dk and dv written only as dqkv's bf16 copy in matmul_wgmma.cl's
// tiled layout (Rp = B T) in dqkv16, the copy the q | k | v product's two gradient products read (Ops keeps it),
// where those products are dqkv's only readers; dqkv itself is not written.
#ifndef DQKV_TILED
#define DQKV_TILED 0
#endif
#if DQKV_TILED
#define DQKV_ARGS , __global uint* restrict dqkv16
#define STORE_DQKV(y, row, col) tiled_store2(dqkv16, row, col, get_num_groups(1) / H * T, y)
#else
#define DQKV_ARGS
#define STORE_DQKV(y, row, col) vstore2(y, 0, dqkv + (size_t)(row) * 3 * C + (col))
#endif

__kernel __attribute__((reqd_work_group_size(NTQ, 1, 1)))
void flash_forward(const int T, __global float* restrict out, __global float* att, const uint seed, const uint site,
                   const float p OUT_TILED_ARGS)
{
    __local uint4 smem[4 * BLK / 16];  // two stages of (k block, v block)
    XW_DECL
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nqb = (T + BR - 1) / BR, qb = nqb - 1 - get_group_id(0);  // the longest rows first
    const int z = get_group_id(1), b = z / H, h = z % H;
    __global const ushort* base =
        (__global const ushort*)(att + COPY_AT(get_num_groups(1), T)) + (size_t)b * T * 3 * C + h * D;
    const uint sb = smem_base(smem), ldn = LDN_OFF(lane), ldt = LDT_OFF(lane);
    const int r0 = qb * BR + 16 * MT * warp;  // m tile i: rows r0 + 16 i ..
    uint qa[MT][KD][4];
    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++) {
        load_a(qa[i], base, 3 * C, r0 + 16 * i, T, lane);
        m[i][0] = m[i][1] = -INFINITY;
        l[i][0] = l[i][1] = 0.0f;
#pragma unroll
        for (int j = 0; j < ND; j++) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
    }
    const float keep = 1.0f / (1.0f - p);
    const int nkb = min((T + BC - 1) / BC, (qb + 1) * (BR / BC));
    stage(sb, base + C, 3 * C, 0, T, smem, NTQ);
    stage(sb + BLK, base + 2 * C, 3 * C, 0, T, smem, NTQ);
    CP_COMMIT();
    for (int kb = 0; kb < nkb; kb++) {
        CP_WAIT0();
        barrier(CLK_LOCAL_MEM_FENCE);  // block kb in; every warp done with block kb - 1, whose stage is next
        if (kb + 1 < nkb) {
            const uint nx = sb + ((kb + 1) & 1) * 2 * BLK;
            stage(nx, base + C, 3 * C, (kb + 1) * BC, T, smem, NTQ);
            stage(nx + BLK, base + 2 * C, 3 * C, (kb + 1) * BC, T, smem, NTQ);
            CP_COMMIT();
        }
        const uint Ks = sb + (kb & 1) * 2 * BLK, Vs = Ks + BLK;
#pragma unroll
        for (int hs = 0; hs < BC / KS; hs++) {  // KS keys a softmax step
            const int k0 = kb * BC + hs * KS;
            if (!WARP_ACTIVE(k0 <= r0 + 16 * MT - 1)) continue;
            float s[MT][KS / 8][4];
            PRODUCT_T(s, MT, KS / 16, qa, Ks, hs * KS)
            const int masked = k0 + KS - 1 > r0 || k0 + KS > T;
#pragma unroll
            for (int i = 0; i < MT; i++) {
                if (masked)
#pragma unroll
                    for (int j = 0; j < KS / 8; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int row = r0 + FRAG_ROW(i, c), key = k0 + FRAG_COL(j, c);
                            s[i][j][c] = CAUSAL_OK(key, row) ? s[i][j][c] : -INFINITY;
                        }
                float mx[2] = {-INFINITY, -INFINITY};  // the step's largest raw score a row
#pragma unroll
                for (int j = 0; j < KS / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) mx[c >> 1] = fmax(mx[c >> 1], s[i][j][c]);
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const float mn = fmax(m[i][u], QUAD_MAX(mx[u]) * SL2);  // max(s) SL2 = max(s SL2): SL2 > 0
                    const float alpha = EXP2(m[i][u] - mn);
                    m[i][u] = mn;
                    l[i][u] *= alpha;
#pragma unroll
                    for (int j = 0; j < ND; j++) { o[i][j][2 * u] *= alpha; o[i][j][2 * u + 1] *= alpha; }
                }
#pragma unroll
                for (int j = 0; j < KS / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const float e = EXP2(fma(s[i][j][c], SL2, -m[i][c >> 1]));
                        l[i][c >> 1] += e;
                        s[i][j][c] = e;
                    }
                if (p > 0.0f)  // uniform: one branch a step, not one an element
#pragma unroll
                    for (int j = 0; j < KS / 8; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int row = r0 + FRAG_ROW(i, c), key = k0 + FRAG_COL(j, c);
                            s[i][j][c] = KEEP(row, key) ? s[i][j][c] * keep : 0.0f;
                        }
            }
            PRODUCT_ACC(o, s, MT, KS / 16, Vs, hs * KS)
        }
    }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            l[i][u] = QUAD_SUM(l[i][u]);
            const int row = r0 + 16 * i + g + 8 * u;
            if (row < T) {
                const float inv = 1.0f / l[i][u];
#pragma unroll
                for (int j = 0; j < ND; j++) {
                    const float2 y = (float2)(o[i][j][2 * u] * inv, o[i][j][2 * u + 1] * inv);
                    vstore2(y, 0, out + ((size_t)b * T + row) * C + h * D + 8 * j + 2 * t);
#if OUT_TILED
                    tiled_store2(out16, b * T + row, h * D + 8 * j + 2 * t, get_num_groups(1) / H * T, y);
#endif
                }
                if (t == 0) att[(size_t)z * T + row] = m[i][u] + log2(l[i][u]);
            }
        }
}

__kernel __attribute__((reqd_work_group_size(NTQ, 1, 1)))
void flash_backward_dq(const int T, __global const float* restrict dout, __global const float* restrict out,
                       __global const float* att, __global float* datt, __global float* restrict dqkv,
                       const uint seed, const uint site, const float p ROPE_ARGS DQKV_ARGS)
{
    __local uint4 smem[4 * BLK / 16];  // two stages of (k block, v block)
    XW_DECL
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nqb = (T + BR - 1) / BR, qb = nqb - 1 - get_group_id(0);
    const int z = get_group_id(1), b = z / H, h = z % H;
    const size_t at = COPY_AT(get_num_groups(1), T);
    __global const ushort* base = (__global const ushort*)(att + at) + (size_t)b * T * 3 * C + h * D;
    __global const ushort* dbase = (__global const ushort*)(datt + at) + (size_t)b * T * C + h * D;
    const uint sb = smem_base(smem), ldn = LDN_OFF(lane), ldt = LDT_OFF(lane);
    const int r0 = qb * BR + 16 * MT * warp;
    uint qa[MT][KD][4], da[MT][KD][4];
    float L[MT][2], dl[MT][2], dq[MT][ND][4];
#pragma unroll
    for (int i = 0; i < MT; i++) {
        load_a(qa[i], base, 3 * C, r0 + 16 * i, T, lane);
        load_a(da[i], dbase, C, r0 + 16 * i, T, lane);
#pragma unroll
        for (int u = 0; u < 2; u++) {  // delta = rowsum(dout * out), fp32 from the fp32 buffers
            const int row = r0 + 16 * i + g + 8 * u;
            float sum = 0.0f;
            if (row < T)  // a quad reads 64 contiguous bytes of each a step (D % 16 == 0)
                for (int d = 4 * t; d < D; d += 16) {
                    const size_t at_ = ((size_t)b * T + row) * C + h * D + d;
                    const float4 x = vload4(0, dout + at_), y = vload4(0, out + at_);
                    sum += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                }
            dl[i][u] = QUAD_SUM(sum);
            L[i][u] = row < T ? att[(size_t)z * T + row] : 0.0f;
            if (row < T && t == 0) datt[(size_t)z * T + row] = dl[i][u];
        }
#pragma unroll
        for (int j = 0; j < ND; j++) dq[i][j][0] = dq[i][j][1] = dq[i][j][2] = dq[i][j][3] = 0.0f;
    }
    const float keep = 1.0f / (1.0f - p);
    const int nkb = min((T + BC - 1) / BC, (qb + 1) * (BR / BC));
    stage(sb, base + C, 3 * C, 0, T, smem, NTQ);
    stage(sb + BLK, base + 2 * C, 3 * C, 0, T, smem, NTQ);
    CP_COMMIT();
    for (int kb = 0; kb < nkb; kb++) {
        CP_WAIT0();
        barrier(CLK_LOCAL_MEM_FENCE);
        if (kb + 1 < nkb) {
            const uint nx = sb + ((kb + 1) & 1) * 2 * BLK;
            stage(nx, base + C, 3 * C, (kb + 1) * BC, T, smem, NTQ);
            stage(nx + BLK, base + 2 * C, 3 * C, (kb + 1) * BC, T, smem, NTQ);
            CP_COMMIT();
        }
        const uint Ks = sb + (kb & 1) * 2 * BLK, Vs = Ks + BLK;
        if (!WARP_ACTIVE(kb * BC <= r0 + 16 * MT - 1)) continue;
        const int masked = kb * BC + BC - 1 > r0 || r0 + 16 * MT > T;
#pragma unroll
        for (int hh = 0; hh < BC / KQ; hh++) {  // KQ keys at a time
            float s[MT][KQ / 8][4], dp[MT][KQ / 8][4];
            PRODUCT_T(s, MT, KQ / 16, qa, Ks, KQ * hh)
            PRODUCT_T(dp, MT, KQ / 16, da, Vs, KQ * hh)
#pragma unroll
            for (int i = 0; i < MT; i++) {
#pragma unroll
                for (int j = 0; j < KQ / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) s[i][j][c] = EXP2(fma(s[i][j][c], SL2, -L[i][c >> 1]));  // s -> P
                if (masked)  // (off it every row is below T)
#pragma unroll
                    for (int j = 0; j < KQ / 8; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int row = r0 + FRAG_ROW(i, c), key = kb * BC + KQ * hh + FRAG_COL(j, c);
                            s[i][j][c] = CAUSAL_OK(key, row) & (row < T) ? s[i][j][c] : 0.0f;
                        }
                if (p > 0.0f)  // ds = P (dP - delta), dP through the dropout mask
#pragma unroll
                    for (int j = 0; j < KQ / 8; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int row = r0 + FRAG_ROW(i, c), key = kb * BC + KQ * hh + FRAG_COL(j, c);
                            const float dpv = KEEP(row, key) ? dp[i][j][c] * keep : 0.0f;
                            s[i][j][c] = s[i][j][c] * (dpv - dl[i][c >> 1]);
                        }
                else
#pragma unroll
                    for (int j = 0; j < KQ / 8; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) s[i][j][c] = s[i][j][c] * (dp[i][j][c] - dl[i][c >> 1]);
            }
            PRODUCT_ACC(dq, s, MT, KQ / 16, Ks, KQ * hh)
        }
    }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int row = r0 + 16 * i + g + 8 * u;
            if (row < T)
#pragma unroll
                for (int j = 0; j < ND; j++) {
                    float2 y = (float2)(dq[i][j][2 * u] * SCALE, dq[i][j][2 * u + 1] * SCALE);
                    ROPE_BACK(y, row, 4 * j + t);  // columns 8j + 2t, +1: pair 4j + t
                    STORE_DQKV(y, b * T + row, h * D + 8 * j + 2 * t);
                }
        }
}

__kernel __attribute__((reqd_work_group_size(NTK, 1, 1)))
void flash_backward_dkv(const int T, __global const float* att, __global const float* datt,
                        __global float* restrict dqkv, const uint seed, const uint site, const float p ROPE_ARGS
                        DQKV_ARGS)
{
    __local uint4 smem[(4 * BLK + 4 * BC * 4) / 16];  // two stages of (q block, dout block), then of (lse, delta)
    XW_DECL
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int kb = get_group_id(0);  // the longest columns (most rows below) first
    const int z = get_group_id(1), b = z / H, h = z % H;
    const size_t at = COPY_AT(get_num_groups(1), T);
    __global const ushort* base = (__global const ushort*)(att + at) + (size_t)b * T * 3 * C + h * D;
    __global const ushort* dbase = (__global const ushort*)(datt + at) + (size_t)b * T * C + h * D;
    __global const float* lse = att + (size_t)z * T;
    __global const float* delta = datt + (size_t)z * T;
    const uint sb = smem_base(smem), ldn = LDN_OFF(lane), ldt = LDT_OFF(lane);
    const int k0 = kb * BRK + 16 * warp;  // this warp's 16 keys
    uint ka[1][KD][4], va[1][KD][4];  // (one m tile: the products' macros take a tile index)
    load_a(ka[0], base + C, 3 * C, k0, T, lane);
    load_a(va[0], base + 2 * C, 3 * C, k0, T, lane);
    float dk[1][ND][4], dv[1][ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) {
        dk[0][j][0] = dk[0][j][1] = dk[0][j][2] = dk[0][j][3] = 0.0f;
        dv[0][j][0] = dv[0][j][1] = dv[0][j][2] = dv[0][j][3] = 0.0f;
    }
    const float keep = 1.0f / (1.0f - p);
    const int q0 = kb * BRK / BC, nqb = (T + BC - 1) / BC;
    // (rows from T on: the last row's statistics, finite; their probabilities are masked to 0)
#define STAGE_Q(st, qb)                                                                                    \
    {                                                                                                      \
        const uint nx_ = sb + (st) * 2 * BLK;                                                              \
        stage(nx_, base, 3 * C, (qb) * BC, T, smem, NTK);                                                  \
        stage(nx_ + BLK, dbase, C, (qb) * BC, T, smem, NTK);                                               \
        if (tid < 2 * BC)                                                                                  \
            CP_ASYNC4(sb + 4 * BLK + ((st) * 2 * BC + tid) * 4,                                            \
                      (tid < BC ? lse : delta) + min((qb) * BC + tid % BC, T - 1));                        \
        CP_COMMIT();                                                                                       \
    }
    STAGE_Q(0, q0)
    for (int qb = q0; qb < nqb; qb++) {
        const int st = (qb - q0) & 1;
        CP_WAIT0();
        barrier(CLK_LOCAL_MEM_FENCE);
        if (qb + 1 < nqb) STAGE_Q(st ^ 1, qb + 1)
        const uint Qs = sb + st * 2 * BLK, Ds = Qs + BLK;
        __local const float* Ls = (__local const float*)smem + (4 * BLK) / 4 + st * 2 * BC;
        __local const float* Dl = Ls + BC;
        if (!WARP_ACTIVE(qb * BC + BC - 1 >= k0)) continue;
#pragma unroll
        for (int sub = 0; sub < BC / QK; sub++) {  // QK queries at a time: s^T, dp^T (16 keys x QK queries)
            if (!WARP_ACTIVE(qb * BC + QK * sub + QK - 1 >= k0)) continue;
            float st_[1][QK / 8][4], dpt[1][QK / 8][4];
            PRODUCT_T(st_, 1, QK / 16, ka, Qs, QK * sub)
            PRODUCT_T(dpt, 1, QK / 16, va, Ds, QK * sub)
            const int masked = qb * BC + QK * sub < k0 + 15 || qb * BC + QK * sub + QK - 1 >= T;
#pragma unroll
            for (int j = 0; j < QK / 8; j++)
#pragma unroll
                for (int c = 0; c < 4; c++)  // st -> P^T
                    st_[0][j][c] = EXP2(fma(st_[0][j][c], SL2, -Ls[QK * sub + FRAG_COL(j, c)]));
            if (masked)  // (off it every row is below T)
#pragma unroll
                for (int j = 0; j < QK / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const int key = k0 + FRAG_ROW(0, c), row = qb * BC + QK * sub + FRAG_COL(j, c);
                        st_[0][j][c] = CAUSAL_OK(key, row) & (row < T) ? st_[0][j][c] : 0.0f;
                    }
            if (p > 0.0f)  // P^T dropped (for dv), dpt -> dS^T (for dk)
#pragma unroll
                for (int j = 0; j < QK / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const int key = k0 + FRAG_ROW(0, c), qi = QK * sub + FRAG_COL(j, c);
                        const float kf = KEEP(qb * BC + qi, key) ? keep : 0.0f, pr = st_[0][j][c];
                        st_[0][j][c] = pr * kf;
                        dpt[0][j][c] = pr * (dpt[0][j][c] * kf - Dl[qi]);
                    }
            else
#pragma unroll
                for (int j = 0; j < QK / 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        dpt[0][j][c] = st_[0][j][c] * (dpt[0][j][c] - Dl[QK * sub + FRAG_COL(j, c)]);
            PRODUCT_ACC(dv, st_, 1, QK / 16, Ds, QK * sub)
            PRODUCT_ACC(dk, dpt, 1, QK / 16, Qs, QK * sub)
        }
    }
#undef STAGE_Q
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int key = k0 + g + 8 * i;
        if (key < T)
#pragma unroll
            for (int j = 0; j < ND; j++) {
                const int col = h * D + 8 * j + 2 * t;
                float2 y = (float2)(dk[0][j][2 * i] * SCALE, dk[0][j][2 * i + 1] * SCALE);
                ROPE_BACK(y, key, 4 * j + t);
                STORE_DQKV(y, b * T + key, C + col);
                STORE_DQKV(((float2)(dv[0][j][2 * i], dv[0][j][2 * i + 1])), b * T + key, 2 * C + col);
            }
    }
}

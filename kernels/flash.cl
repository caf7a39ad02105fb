// Causal self-attention as fused kernels (flash attention 2, Dao 2023) on NVIDIA tensor cores, precision bf16:
// the T x T scores never reach memory. Each work-group takes a block of 64 rows of one (batch, head), its 4
// warps 16 rows each, and walks the other side's 64-row blocks through local memory; products on
// mma.sync.m16n8k16 (mma_bf16.cl) with bf16 operands (q, k, v, dout, the probabilities and their gradient,
// rounded to nearest even as precision.cl) and fp32 accumulators; softmax, its statistics and the gradients'
// sums stay fp32.
//   flash_forward       out (B,T,C) from qkv (B,T,3C), and lse (B*H*T): each row's log2 of its softmax sum
//                       over scores in the log2 domain (s * SCALE * log2 e), the backward's recomputation
//   flash_backward_dq   dq into dqkv (B,T,3C), and delta (B*H*T) = rowsum(dout * out), from dout (B,T,C)
//   flash_backward_dkv  dk, dv into dqkv; reads delta, so it runs after flash_backward_dq
// Row-major (B, T, .) buffers of the batch's T; head h's q, k, v at columns h*D, C + h*D, 2C + h*D.
// Dropout (p > 0) on the probabilities as dropout.cl with element index (z*T + query)*T + key, z = b*H + h:
// the same mask the batched form (attention.cl, att of shape (B,H,T,T)) draws; the row sums use the kept
// probabilities before dropout, the products with v the dropped ones.
// Fragments are read from local memory as 32-bit words: rows padded by 8 bf16 (16 bytes), so the 8 rows x 4
// words one fragment load touches fall in 32 distinct banks. Operands needed as B with their rows along n are
// staged transposed. Work-group 128 (4 warps); global (ceil(T/64) * 128, B*H).
// -D: C H D (head width: a multiple of 16, at most 64), SCALE; MMA_EMULATE (PoCL tests: mma and the quad
// reductions through local exchanges).
#include "precision.cl"
#include "mma_bf16.cl"
#include "dropout.cl"

#define BQ 64             // rows a work-group, and rows a staged block
#define NTH 128
#define DP (D + 8)        // local row of a D-wide block (bf16)
#define KP (BQ + 8)       // local row of a transposed block: BQ wide
#define ND (D / 8)        // n tiles across the head
#define KD (D / 16)       // k steps across the head
#define SL2 (SCALE * 1.4426950408889634f)
#define LDW(p, i) (*(__local const uint*)((p) + (i)))  // two bf16 at even element i

#if MMA_EMULATE
#define XW_DECL                                  \
    __local uint xbuf[4 * 224];                  \
    __local uint* xw = xbuf + (get_local_id(0) >> 5) * 224;
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
#else
#define XW_DECL
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
#endif


// A 64-row block in two steps: fetch reads rows r0..r0+63 (zeros from row T on) of D columns of src (row
// stride ld) into registers, 4 columns a load, all of a work-item's loads issued together (consecutive
// work-items on consecutive columns: coalesced); put stores them as bf16 into dst [row][DP] and/or dstT
// [column][KP]. (Measured on the H200: consecutive rows a warp instead, for conflict-free transposed stores,
// took 1.5x the time; holding the next block's loads during this one's products took 254 registers, no gain.)
#define NPER (BQ * D / 4 / NTH)
inline void fetch(float4* v, __global const float* src, const int ld, const int r0, const int T)
{
#pragma unroll
    for (int i = 0; i < NPER; i++) {
        const int e = get_local_id(0) + i * NTH, r = e / (D / 4), c = 4 * (e % (D / 4));
        v[i] = r0 + r < T ? vload4(0, src + (size_t)(r0 + r) * ld + c) : (float4)(0.0f);
    }
}

inline void put(const float4* v, __local ushort* dst, __local ushort* dstT)
{
#pragma unroll
    for (int i = 0; i < NPER; i++) {
        const int e = get_local_id(0) + i * NTH, r = e / (D / 4), c = 4 * (e % (D / 4));
        if (dst) *(__local uint2*)(dst + r * DP + c) = (uint2)(bf16x2(v[i].x, v[i].y), bf16x2(v[i].z, v[i].w));
        if (dstT) {
            dstT[(c + 0) * KP + r] = (ushort)bf16_bits(v[i].x);
            dstT[(c + 1) * KP + r] = (ushort)bf16_bits(v[i].y);
            dstT[(c + 2) * KP + r] = (ushort)bf16_bits(v[i].z);
            dstT[(c + 3) * KP + r] = (ushort)bf16_bits(v[i].w);
        }
    }
}

// Block kb (64 rows) of one head's k and v (base: the head's q columns of qkv) into local memory: k into Ks
// [row][DP] and/or Kt [column][KP], v into Vs and/or Vt (0: not wanted), between barriers (every warp is done
// with the block before; the block is in before any warp reads it).
inline void stage_kv(__global const float* base, const int kb, const int T, __local ushort* Ks, __local ushort* Kt,
                     __local ushort* Vs, __local ushort* Vt)
{
    float4 kr[NPER], vr[NPER];
    fetch(kr, base + C, 3 * C, kb * BQ, T);
    fetch(vr, base + 2 * C, 3 * C, kb * BQ, T);
    barrier(CLK_LOCAL_MEM_FENCE);
    put(kr, Ks, Kt);
    put(vr, Vs, Vt);
    barrier(CLK_LOCAL_MEM_FENCE);
}

// A fragments (16 rows from r0, all D columns; zeros from row T on) of src (row stride ld)
inline void load_a(uint a[KD][4], __global const float* src, const int ld, const int r0, const int T, const int lane)
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < KD; s++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = r0 + g + 8 * (q & 1), c = 16 * s + 2 * t + 8 * (q >> 1);
            const float2 v = r < T ? vload2(0, src + (size_t)r * ld + c) : (float2)(0.0f);
            a[s][q] = bf16x2(v.x, v.y);
        }
}

// c (16 x 8n accumulators of a warp, from n tile 2j) as the A fragment of one k step of 16
#define AFRAG(a, c, j)                                \
    {                                                 \
        a[0] = bf16x2(c[2 * (j)][0], c[2 * (j)][1]);         \
        a[1] = bf16x2(c[2 * (j)][2], c[2 * (j)][3]);         \
        a[2] = bf16x2(c[2 * (j) + 1][0], c[2 * (j) + 1][1]); \
        a[3] = bf16x2(c[2 * (j) + 1][2], c[2 * (j) + 1][3]); \
    }

// A warp's products with a staged 64-row block (g, t: the lane's fragment row and column):
// PRODUCT_T: c (16 rows x 64: 8 n tiles) = a (16 x D, A fragments) @ X^T, X staged as Xs [64][DP];
// PRODUCT_ACC: acc (16 x D: ND n tiles) += c (16 x 64, rounded to bf16 A fragments) @ X, X staged as Xt [D][KP].
#define PRODUCT_T(c, a, Xs)                                                                 \
    _Pragma("unroll") for (int j_ = 0; j_ < 8; j_++) {                                      \
        c[j_][0] = c[j_][1] = c[j_][2] = c[j_][3] = 0.0f;                                   \
        _Pragma("unroll") for (int k_ = 0; k_ < KD; k_++)                                   \
            MMA16816(c[j_], a[k_], LDW(Xs, (8 * j_ + g) * DP + 16 * k_ + 2 * t),            \
                     LDW(Xs, (8 * j_ + g) * DP + 16 * k_ + 8 + 2 * t));                     \
    }
#define PRODUCT_ACC(acc, c, Xt)                                                             \
    _Pragma("unroll") for (int k_ = 0; k_ < 4; k_++) {                                      \
        uint a_[4];                                                                         \
        AFRAG(a_, c, k_)                                                                    \
        _Pragma("unroll") for (int j_ = 0; j_ < ND; j_++)                                   \
            MMA16816(acc[j_], a_, LDW(Xt, (8 * j_ + g) * KP + 16 * k_ + 2 * t),             \
                     LDW(Xt, (8 * j_ + g) * KP + 16 * k_ + 8 + 2 * t));                     \
    }
// dropout's keep of the probability (query row, key) of head z: the batched form's element (z, row, key)
#define KEEP(row, key) dropout_keep(seed, site, (uint)(((size_t)z * T + (row)) * T + (key)), p)

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
__kernel __attribute__((reqd_work_group_size(NTH, 1, 1)))
void flash_forward(const int T, __global const float* restrict qkv, __global float* restrict out,
                   __global float* restrict lse, const uint seed, const uint site, const float p OUT_TILED_ARGS)
{
    __local uint4 ks_[BQ * DP / 8], vt_[D * KP / 8];  // (uint4: aligned for the word and pair accesses)
    __local ushort *Ks = (__local ushort*)ks_, *Vt = (__local ushort*)vt_;
    XW_DECL
    const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5, g = lane >> 2, t = lane & 3;
    const int nb = (T + BQ - 1) / BQ, qb = nb - 1 - get_group_id(0);  // the longest rows first
    const int z = get_group_id(1), b = z / H, h = z % H;
    __global const float* base = qkv + (size_t)b * T * 3 * C + h * D;
    const int r0 = qb * BQ + 16 * warp;
    uint qa[KD][4];
    load_a(qa, base, 3 * C, r0, T, lane);
    float o[ND][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < ND; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    const float keep = 1.0f / (1.0f - p);
    for (int kb = 0; kb <= qb; kb++) {
        stage_kv(base, kb, T, Ks, 0, 0, Vt);
        float s[8][4];
        PRODUCT_T(s, qa, Ks)
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int row = r0 + g + 8 * (c >> 1), key = kb * BQ + 8 * j + 2 * t + (c & 1);
                s[j][c] = (key <= row && key < T) ? s[j][c] * SL2 : -INFINITY;
                mx[c >> 1] = fmax(mx[c >> 1], s[j][c]);
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = QUAD_MAX(mx[i]);
            const float alpha = native_exp2(m[i] - mx[i]);
            m[i] = mx[i];
            l[i] *= alpha;
#pragma unroll
            for (int j = 0; j < ND; j++) { o[j][2 * i] *= alpha; o[j][2 * i + 1] *= alpha; }
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float e = native_exp2(s[j][c] - m[c >> 1]);
                l[c >> 1] += e;
                if (p > 0.0f) {
                    const int row = r0 + g + 8 * (c >> 1), key = kb * BQ + 8 * j + 2 * t + (c & 1);
                    e = KEEP(row, key) ? e * keep : 0.0f;
                }
                s[j][c] = e;
            }
        PRODUCT_ACC(o, s, Vt)
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = QUAD_SUM(l[i]);
        const int row = r0 + g + 8 * i;
        if (row < T) {
            const float inv = 1.0f / l[i];
#pragma unroll
            for (int j = 0; j < ND; j++) {
                const float2 y = (float2)(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
                vstore2(y, 0, out + ((size_t)b * T + row) * C + h * D + 8 * j + 2 * t);
#if OUT_TILED
                tiled_store2(out16, b * T + row, h * D + 8 * j + 2 * t, get_num_groups(1) / H * T, y);
#endif
            }
            if (t == 0) lse[(size_t)z * T + row] = m[i] + log2(l[i]);
        }
    }
}

__kernel __attribute__((reqd_work_group_size(NTH, 1, 1)))
void flash_backward_dq(const int T, __global const float* restrict dout, __global const float* restrict qkv,
                       __global const float* restrict out, __global const float* restrict lse,
                       __global float* restrict delta, __global float* restrict dqkv,
                       const uint seed, const uint site, const float p)
{
    __local uint4 ks_[BQ * DP / 8], vs_[BQ * DP / 8], kt_[D * KP / 8];
    __local ushort *Ks = (__local ushort*)ks_, *Vs = (__local ushort*)vs_, *Kt = (__local ushort*)kt_;
    XW_DECL
    const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5, g = lane >> 2, t = lane & 3;
    const int nb = (T + BQ - 1) / BQ, qb = nb - 1 - get_group_id(0);
    const int z = get_group_id(1), b = z / H, h = z % H;
    __global const float* base = qkv + (size_t)b * T * 3 * C + h * D;
    __global const float* dbase = dout + (size_t)b * T * C + h * D;
    const int r0 = qb * BQ + 16 * warp;
    uint qa[KD][4], da[KD][4];
    load_a(qa, base, 3 * C, r0, T, lane);
    load_a(da, dbase, C, r0, T, lane);
    float L[2], dl[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {  // delta = rowsum(dout * out), fp32 from the fp32 buffers
        const int row = r0 + g + 8 * i;
        float sum = 0.0f;
        if (row < T)
            for (int d = t; d < D; d += 4)
                sum += dbase[(size_t)row * C + d] * out[((size_t)b * T + row) * C + h * D + d];
        dl[i] = QUAD_SUM(sum);
        L[i] = row < T ? lse[(size_t)z * T + row] : 0.0f;
        if (row < T && t == 0) delta[(size_t)z * T + row] = dl[i];
    }
    float dq[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
    const float keep = 1.0f / (1.0f - p);
    for (int kb = 0; kb <= qb; kb++) {
        stage_kv(base, kb, T, Ks, Kt, Vs, 0);
        float s[8][4], dp[8][4];
        PRODUCT_T(s, qa, Ks)
        PRODUCT_T(dp, da, Vs)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {  // ds = P (dP - delta), dP through the dropout mask
                const int row = r0 + g + 8 * (c >> 1), key = kb * BQ + 8 * j + 2 * t + (c & 1);
                const float pr = (key <= row && row < T) ? native_exp2(s[j][c] * SL2 - L[c >> 1]) : 0.0f;
                float dpv = dp[j][c];
                if (p > 0.0f)
                    dpv = KEEP(row, key) ? dpv * keep : 0.0f;
                s[j][c] = pr * (dpv - dl[c >> 1]);
            }
        PRODUCT_ACC(dq, s, Kt)
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = r0 + g + 8 * i;
        if (row < T)
#pragma unroll
            for (int j = 0; j < ND; j++)
                vstore2((float2)(dq[j][2 * i] * SCALE, dq[j][2 * i + 1] * SCALE), 0,
                        dqkv + ((size_t)b * T + row) * 3 * C + h * D + 8 * j + 2 * t);
    }
}

__kernel __attribute__((reqd_work_group_size(NTH, 1, 1)))
void flash_backward_dkv(const int T, __global const float* restrict dout, __global const float* restrict qkv,
                        __global const float* restrict lse, __global const float* restrict delta,
                        __global float* restrict dqkv, const uint seed, const uint site, const float p)
{
    __local uint4 qs_[BQ * DP / 8], qt_[D * KP / 8], ds_[BQ * DP / 8], dt_[D * KP / 8];
    __local ushort *Qs = (__local ushort*)qs_, *Qt = (__local ushort*)qt_, *Ds = (__local ushort*)ds_,
                   *Dt = (__local ushort*)dt_;
    __local float Ls[BQ], Dl[BQ];
    XW_DECL
    const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5, g = lane >> 2, t = lane & 3;
    const int nb = (T + BQ - 1) / BQ, kb = get_group_id(0);  // the longest columns (most rows below) first
    const int z = get_group_id(1), b = z / H, h = z % H;
    __global const float* base = qkv + (size_t)b * T * 3 * C + h * D;
    __global const float* dbase = dout + (size_t)b * T * C + h * D;
    const int k0 = kb * BQ + 16 * warp;  // this warp's 16 keys
    uint ka[KD][4], va[KD][4];
    load_a(ka, base + C, 3 * C, k0, T, lane);
    load_a(va, base + 2 * C, 3 * C, k0, T, lane);
    float dk[ND][4], dv[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) {
        dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.0f;
        dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.0f;
    }
    const float keep = 1.0f / (1.0f - p);
    float4 qr[NPER], dr[NPER];
    const int li = get_local_id(0);
    for (int qb = kb; qb < nb; qb++) {
        const int r1 = qb * BQ, row = r1 + li;
        fetch(qr, base, 3 * C, r1, T);
        fetch(dr, dbase, C, r1, T);
        const float lr = li < BQ && row < T ? lse[(size_t)z * T + row] : 0.0f;  // work-items 0..63: a row each
        const float dlr = li < BQ && row < T ? delta[(size_t)z * T + row] : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        put(qr, Qs, Qt);
        put(dr, Ds, Dt);
        if (li < BQ) {
            Ls[li] = lr;
            Dl[li] = dlr;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int sub = 0; sub < BQ / 16; sub++) {  // 16 queries at a time: s^T, dp^T (16 keys x 16 queries)
            float st[2][4], dpt[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.0f;
                dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KD; kk++) {
                    const int i0 = (16 * sub + 8 * j + g) * DP + 16 * kk + 2 * t;
                    MMA16816(st[j], ka[kk], LDW(Qs, i0), LDW(Qs, i0 + 8));
                    MMA16816(dpt[j], va[kk], LDW(Ds, i0), LDW(Ds, i0 + 8));
                }
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) {  // st -> dropped P^T (for dv), dpt -> dS^T (for dk)
                    const int key = k0 + g + 8 * (c >> 1), qi = 16 * sub + 8 * j + 2 * t + (c & 1);
                    const int row = qb * BQ + qi;
                    const float pr = (key <= row && row < T) ? native_exp2(st[j][c] * SL2 - Ls[qi]) : 0.0f;
                    float kf = 1.0f;
                    if (p > 0.0f)
                        kf = KEEP(row, key) ? keep : 0.0f;
                    st[j][c] = pr * kf;
                    dpt[j][c] = pr * (dpt[j][c] * kf - Dl[qi]);
                }
            uint pa[4], sa[4];
            AFRAG(pa, st, 0)
            AFRAG(sa, dpt, 0)
#pragma unroll
            for (int j = 0; j < ND; j++) {
                const int i0 = (8 * j + g) * KP + 16 * sub + 2 * t;
                MMA16816(dv[j], pa, LDW(Dt, i0), LDW(Dt, i0 + 8));
                MMA16816(dk[j], sa, LDW(Qt, i0), LDW(Qt, i0 + 8));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int key = k0 + g + 8 * i;
        if (key < T)
#pragma unroll
            for (int j = 0; j < ND; j++) {
                __global float* o = dqkv + ((size_t)b * T + key) * 3 * C + h * D + 8 * j + 2 * t;
                vstore2((float2)(dk[j][2 * i] * SCALE, dk[j][2 * i + 1] * SCALE), 0, o + C);
                vstore2((float2)(dv[j][2 * i], dv[j][2 * i + 1]), 0, o + 2 * C);
            }
    }
}

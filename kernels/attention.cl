// Causal multi-head self-attention.  -D: C, H, D (= C/H), SCALE (= 1/sqrt(D))
// qkv (B,T,3C): q | k | v, head h at columns h*D..(h+1)*D-1 of each; out (B,T,C); att (B,H,T,T).
//   forward:  att[b,h,t,:] = softmax_{t2<=t}(SCALE * q_t . k_t2),  out[b,t,h] = sum_t2 att * v_t2
//   backward: dp = dout_t . v_t2;  ds = att * (dp - sum_t2 att * dp)  (kept in datt)
//             dq_t = SCALE sum_t2 ds k_t2;  dk_t2 = SCALE sum_t ds q_t;  dv_t2 = sum_t att dout_t
// One work-item per (query t | key t2, b*H+h), every sum in a fixed order: deterministic, no atomics.
// -DVEC=1 (CPUs) handles head vectors as D/8 float8 when D is a multiple of 8, else one float at a time:
// explicit vectors keep PoCL from scalarising the per-work-item loops, whose trip counts differ.
#ifndef C
#error "C must be defined"
#endif
#define C3 (3 * C)

#ifndef VEC
#define VEC 0
#endif
#if VEC && D % 8 == 0
#define W 8
typedef float floatw __attribute__((ext_vector_type(8), aligned(4)));
#define HSUM(v) ({ const float4 h4 = (v).lo + (v).hi; const float2 h2 = h4.lo + h4.hi; h2.x + h2.y; })
#else
#define W 1
typedef float floatw;
#define HSUM(v) (v)
#endif
#define DV (D / W)
#define LDW(p, i) (((__global const floatw*)(p))[i])
#define STW(p, i, v) (((__global floatw*)(p))[i] = (v))

__kernel void attention_forward(const int B, const int T, __global const float* qkv,
                                __global float* out, __global float* att)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* q = qkv + (b * T + t) * C3 + h * D;
    __global float* arow = att + (bh * T + t) * T;
    floatw qv[DV];
    for (int d = 0; d < DV; d++) qv[d] = LDW(q, d);
    float mx = -INFINITY;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += qv[d] * LDW(k, d);
        const float sc = HSUM(s) * SCALE;
        arow[t2] = sc;
        mx = fmax(mx, sc);
    }
    float sum = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float e = exp(arow[t2] - mx);
        arow[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
    floatw acc[DV];
    for (int d = 0; d < DV; d++) acc[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float p = arow[t2] * inv;
        arow[t2] = p;
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        for (int d = 0; d < DV; d++) acc[d] += p * LDW(v, d);
    }
    for (int t2 = t + 1; t2 < T; t2++) arow[t2] = 0.0f;
    __global float* o = out + (b * T + t) * C + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, acc[d]);
}

// Per query row: ds into datt, dq into dqkv (overwrites the q part).
__kernel void attention_backward_query(const int B, const int T, __global const float* dout,
                                       __global const float* qkv, __global const float* att,
                                       __global float* datt, __global float* dqkv)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* arow = att + (bh * T + t) * T;
    __global float* drow = datt + (bh * T + t) * T;
    floatw dy[DV];
    for (int d = 0; d < DV; d++) dy[d] = LDW(dout + (b * T + t) * C + h * D, d);
    float sdot = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += dy[d] * LDW(v, d);
        const float dp = HSUM(s);
        drow[t2] = dp;
        sdot += arow[t2] * dp;
    }
    floatw dq[DV];
    for (int d = 0; d < DV; d++) dq[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float ds = arow[t2] * (drow[t2] - sdot);
        drow[t2] = ds;
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        for (int d = 0; d < DV; d++) dq[d] += ds * LDW(k, d);
    }
    __global float* o = dqkv + (b * T + t) * C3 + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, dq[d] * SCALE);
}

// Per key row t2: dk, dv into dqkv (overwrites the k and v parts). Reads ds from datt.
__kernel void attention_backward_key(const int B, const int T, __global const float* dout,
                                     __global const float* qkv, __global const float* att,
                                     __global const float* datt, __global float* dqkv)
{
    const int t2 = get_global_id(0), bh = get_global_id(1);
    if (t2 >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    floatw dk[DV], dv[DV];
    for (int d = 0; d < DV; d++) { dk[d] = 0.0f; dv[d] = 0.0f; }
    // t descends from T-1 for every work-item: neighbouring key rows read the same q, dout row together
    for (int t = T - 1; t >= t2; t--) {
        const float ds = datt[(bh * T + t) * T + t2];
        const float p = att[(bh * T + t) * T + t2];
        __global const float* q = qkv + (b * T + t) * C3 + h * D;
        __global const float* dy = dout + (b * T + t) * C + h * D;
        for (int d = 0; d < DV; d++) { dk[d] += ds * LDW(q, d); dv[d] += p * LDW(dy, d); }
    }
    __global float* o = dqkv + (b * T + t2) * C3 + h * D;
    for (int d = 0; d < DV; d++) { STW(o + C, d, dk[d] * SCALE); STW(o + 2 * C, d, dv[d]); }
}

// ---- GPUs: attention as batched matmuls (kernels/matmul.cl, BATCH=1, CAUSAL) plus these two row kernels ----
// One work-group of LW work-items per row r of att (B*H*T rows of T; query t = r % T), fixed-order tree
// reductions: deterministic.
//   attention_softmax:  att[r, t2] = softmax_{t2 <= t}(att[r, :])  (att holds SCALE * q.k), 0 for t2 > t
//   attention_dsoftmax: datt[r, t2] = att * (dp - sum_t2 att * dp)  (datt holds dp = dout . v), 0 for t2 > t
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void attention_softmax(const int T, __global float* att)
{
    const int r = get_group_id(0), l = get_local_id(0), t = r % T;
    __global float* row = att + (size_t)r * T;
    __local float red[LW];
    float mx = -INFINITY;
    for (int j = l; j <= t; j += LW) mx = fmax(mx, row[j]);
    mx = wg_reduce(red, mx, 1);
    float s = 0.0f;
    for (int j = l; j <= t; j += LW) {
        const float e = exp(row[j] - mx);
        row[j] = e;
        s += e;
    }
    const float inv = 1.0f / wg_reduce(red, s, 0);
    for (int j = l; j < T; j += LW) row[j] = j <= t ? row[j] * inv : 0.0f;
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void attention_dsoftmax(const int T, __global const float* att, __global float* datt)
{
    const int r = get_group_id(0), l = get_local_id(0), t = r % T;
    __global const float* arow = att + (size_t)r * T;
    __global float* drow = datt + (size_t)r * T;
    __local float red[LW];
    float s = 0.0f;
    for (int j = l; j <= t; j += LW) s += arow[j] * drow[j];
    s = wg_reduce(red, s, 0);
    for (int j = l; j < T; j += LW) drow[j] = j <= t ? arow[j] * (drow[j] - s) : 0.0f;
}


// Causal attention forward and query-side backward of kernels/attention.cl (same arguments, same launch),
// with the q.k and dout.v dot products taken 4 keys at a time (4 independent float8 FMA chains; each key's
// sum in the same order as attention.cl) and the forward's softmax exps as float8 (PoCL's scalar exp is
// ~7 ns: it was 40% of the forward at T=256). The backward matches attention.cl's bit for bit; the
// forward's softmax sums its lanes in another order. -D: C, H, D, SCALE (D % 8 == 0 for float8, else one
// float at a time).
#if VEC  // CPUs: attention.cl's head-vector macros above (W 8 where D % 8 == 0) serve these forms too
#ifndef ROWS_RB
#define ROWS_RB 0
#endif
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define VLD(p) (*(__global const float8u*)(p))
#define VST(p, v) (*(__global float8u*)(p) = (v))

// s_j = x . rows[j * C3], j < 4, each summed over d in order (4 independent chains)
#define DOT4(x, r, s0, s1, s2, s3)                                                    \
    floatw s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                 \
    for (int d = 0; d < DV; d++) {                                                     \
        const floatw xd = (x)[d];                                                      \
        s0 += xd * LDW((r), d);                                                        \
        s1 += xd * LDW((r) + C3, d);                                                   \
        s2 += xd * LDW((r) + 2 * C3, d);                                               \
        s3 += xd * LDW((r) + 3 * C3, d);                                               \
    }

__kernel void attention_forward_u4(const int B, const int T, __global const float* qkv,
                                   __global float* out, __global float* att)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* q = qkv + (b * T + t) * C3 + h * D;
    __global float* arow = att + (bh * T + t) * T;
    floatw qv[DV];
    for (int d = 0; d < DV; d++) qv[d] = LDW(q, d);
    float mx = -INFINITY;
    int t2 = 0;
    for (; t2 + 3 <= t; t2 += 4) {
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        DOT4(qv, k, s0, s1, s2, s3)
        const float c0 = HSUM(s0) * SCALE, c1 = HSUM(s1) * SCALE, c2 = HSUM(s2) * SCALE, c3 = HSUM(s3) * SCALE;
        arow[t2] = c0; arow[t2 + 1] = c1; arow[t2 + 2] = c2; arow[t2 + 3] = c3;
        mx = fmax(fmax(mx, fmax(c0, c1)), fmax(c2, c3));
    }
    for (; t2 <= t; t2++) {
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += qv[d] * LDW(k, d);
        const float sc = HSUM(s) * SCALE;
        arow[t2] = sc;
        mx = fmax(mx, sc);
    }
    // the exps 8 at a time (a float8 exp costs about what one scalar exp does), lanes summed at the end
    float8 sv = 0.0f;
    for (t2 = 0; t2 + 7 <= t; t2 += 8) {
        const float8 e = exp(VLD(arow + t2) - mx);
        VST(arow + t2, e);
        sv += e;
    }
    float sum = ({ const float4 h4 = sv.lo + sv.hi; const float2 h2 = h4.lo + h4.hi; h2.x + h2.y; });
    for (; t2 <= t; t2++) {
        const float e = exp(arow[t2] - mx);
        arow[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
#if ROWS_RB  // out = att @ v follows in attention_rows_rb
    for (t2 = 0; t2 <= t; t2++) arow[t2] *= inv;
    for (t2 = t + 1; t2 < T; t2++) arow[t2] = 0.0f;
    return;
#endif
    floatw acc[DV];
    for (int d = 0; d < DV; d++) acc[d] = 0.0f;
    for (t2 = 0; t2 <= t; t2++) {
        const float p = arow[t2] * inv;
        arow[t2] = p;
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        for (int d = 0; d < DV; d++) acc[d] += p * LDW(v, d);
    }
    for (t2 = t + 1; t2 < T; t2++) arow[t2] = 0.0f;
    __global float* o = out + (b * T + t) * C + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, acc[d]);
}

__kernel void attention_backward_query_u4(const int B, const int T, __global const float* dout,
                                          __global const float* qkv, __global const float* att,
                                          __global float* datt, __global float* dqkv)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* arow = att + (bh * T + t) * T;
    __global float* drow = datt + (bh * T + t) * T;
    floatw dy[DV];
    for (int d = 0; d < DV; d++) dy[d] = LDW(dout + (b * T + t) * C + h * D, d);
    float sdot = 0.0f;
    int t2 = 0;
    for (; t2 + 3 <= t; t2 += 4) {
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        DOT4(dy, v, s0, s1, s2, s3)
        const float p0 = HSUM(s0), p1 = HSUM(s1), p2 = HSUM(s2), p3 = HSUM(s3);
        drow[t2] = p0; drow[t2 + 1] = p1; drow[t2 + 2] = p2; drow[t2 + 3] = p3;
        sdot += arow[t2] * p0;
        sdot += arow[t2 + 1] * p1;
        sdot += arow[t2 + 2] * p2;
        sdot += arow[t2 + 3] * p3;
    }
    for (; t2 <= t; t2++) {
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += dy[d] * LDW(v, d);
        const float dp = HSUM(s);
        drow[t2] = dp;
        sdot += arow[t2] * dp;
    }
#if ROWS_RB  // dq = SCALE datt @ k follows in attention_rows_rb
    for (t2 = 0; t2 <= t; t2++) drow[t2] = arow[t2] * (drow[t2] - sdot);
    return;
#endif
    floatw dq[DV];
    for (int d = 0; d < DV; d++) dq[d] = 0.0f;
    for (t2 = 0; t2 <= t; t2++) {
        const float ds = arow[t2] * (drow[t2] - sdot);
        drow[t2] = ds;
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        for (int d = 0; d < DV; d++) dq[d] += ds * LDW(k, d);
    }
    __global float* o = dqkv + (b * T + t) * C3 + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, dq[d] * SCALE);
}

// Key-side backward of kernels/attention.cl (attention_backward_key: same arguments) as register-blocked
// products: dk = SCALE ds^T q, dv = att^T dout over t >= t2, each work-item RK adjacent keys x 16 columns
// (two float8) of one head of dk or dv. The RK values ds[t, t2..t2+RK-1] (att likewise) are contiguous in
// a row, so the reads go along rows, not down columns; t descends as in attention.cl (same order of
// summation; rows above the diagonal contribute 0). D % 16 == 0.
// Global size (ceil(T / RK), B * H * D / 8): dimension 1 is bh * (D / 8) + column block, blocks
// 0..D/16-1 of dk, then D/16..D/8-1 of dv.
#if D % 16 == 0
// O[b, t, col..] = sc * sum_{t2 <= t} A[bh, t, t2] Bm[b, t2, col..] for the head's D columns (attention's
// att @ v and datt @ k, with ROWS_RB=1 u4 kernels doing the rest), t2 ascending as in the u4 kernels (the
// same sums, bit for bit); entries of A above the diagonal are not read. Each work-item 6 rows t x 16
// columns; global size (ceil(T / 6), B * H * D / 16), dimension 1 = bh * (D / 16) + column block.
// Bm, O: row b*T + t at Bm + boff + (b*T + t) * ldb + h*D (O likewise with ooff, ldo).
__kernel void attention_rows_rb(const int B, const int T, __global const float* A, __global const float* Bm,
                                const int boff, const int ldb, __global float* O, const int ooff, const int ldo,
                                const float sc)
{
    const int t0 = get_global_id(0) * 6, g1 = get_global_id(1);
    if (t0 >= T || g1 >= B * H * (D / 16)) return;
    const int bh = g1 / (D / 16), cb = g1 % (D / 16), b = bh / H, h = bh % H;
    const int col = h * D + cb * 16;
    __global const float* Ab = A + (size_t)bh * T * T;
    __global const float* bp = Bm + boff + (size_t)b * T * ldb + col;
    __global const float* ar[6];  // each row through its own pointer: scalar addressing (as matmul_rb's)
#pragma unroll
    for (int i = 0; i < 6; i++) ar[i] = Ab + min(t0 + i, T - 1) * T;
    float8 acc[6][2];
#pragma unroll
    for (int i = 0; i < 6; i++) { acc[i][0] = 0.0f; acc[i][1] = 0.0f; }
    int t2 = 0;
    for (; t2 <= t0; t2++, bp += ldb) {  // every row of the block is >= t2
        const float8 b0 = VLD(bp), b1 = VLD(bp + 8);
#pragma unroll
        for (int i = 0; i < 6; i++) {
            const float a = ar[i][t2];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    const int tend = min(T - 1, t0 + 5);
    for (; t2 <= tend; t2++, bp += ldb) {  // the diagonal block: row t0 + i only while t2 <= t0 + i
        const float8 b0 = VLD(bp), b1 = VLD(bp + 8);
#pragma unroll
        for (int i = 0; i < 6; i++) {
            if (t2 <= t0 + i) {
                const float a = ar[i][t2];
                acc[i][0] += a * b0;
                acc[i][1] += a * b1;
            }
        }
    }
    __global float* o = O + ooff + (size_t)(b * T + t0) * ldo + col;
#pragma unroll
    for (int i = 0; i < 6; i++) {
        if (t0 + i >= T) break;
        VST(o + (size_t)i * ldo, acc[i][0] * sc);
        VST(o + (size_t)i * ldo + 8, acc[i][1] * sc);
    }
}

#define RK 6
#define NCB (D / 8)
__kernel void attention_backward_key_rb(const int B, const int T, __global const float* dout,
                                        __global const float* qkv, __global const float* att,
                                        __global const float* datt, __global float* dqkv)
{
    const int t0 = get_global_id(0) * RK, g1 = get_global_id(1);
    if (t0 >= T || g1 >= B * H * NCB) return;
    const int bh = g1 / NCB, cb = g1 % NCB, b = bh / H, h = bh % H;
    const int is_v = cb >= NCB / 2, col = h * D + (cb % (NCB / 2)) * 16;
    __global const float* A = (is_v ? att : datt) + (size_t)bh * T * T + t0;
    __global const float* Bm = is_v ? dout + (size_t)b * T * C + col : qkv + (size_t)b * T * C3 + col;
    const int ldb = is_v ? C : C3;
    float8 acc[RK][2];
#pragma unroll
    for (int i = 0; i < RK; i++) { acc[i][0] = 0.0f; acc[i][1] = 0.0f; }
    int t = T - 1;
    for (; t >= t0 + RK - 1; t--) {  // every key of the block is <= t
        __global const float* bp = Bm + (size_t)t * ldb;
        const float8 b0 = VLD(bp), b1 = VLD(bp + 8);
        __global const float* ap = A + (size_t)t * T;
#pragma unroll
        for (int i = 0; i < RK; i++) {
            const float a = ap[i];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    for (; t >= t0; t--) {  // the diagonal block: key t0 + i only while t0 + i <= t
        __global const float* bp = Bm + (size_t)t * ldb;
        const float8 b0 = VLD(bp), b1 = VLD(bp + 8);
        __global const float* ap = A + (size_t)t * T;
#pragma unroll
        for (int i = 0; i < RK; i++) {
            if (t0 + i <= t) {
                const float a = ap[i];
                acc[i][0] += a * b0;
                acc[i][1] += a * b1;
            }
        }
    }
    const float sc = is_v ? 1.0f : SCALE;
    __global float* o = dqkv + (size_t)(b * T + t0) * C3 + (is_v ? 2 * C : C) + col;
#pragma unroll
    for (int i = 0; i < RK; i++) {
        if (t0 + i >= T) break;
        VST(o + (size_t)i * C3, acc[i][0] * sc);
        VST(o + (size_t)i * C3 + 8, acc[i][1] * sc);
    }
}
#endif
#endif

// CPU-only kernels (PoCL), chosen per device type in clgpt/tuning.py; the GPU forms live in the per-op files.
// Explicit float8 vectors (the AVX2 width PoCL targets here): PoCL does not vectorise loops whose
// accesses are strided across work-items.
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define VLD(p) (*(__global const float8u*)(p))
#define VST(p, v) (*(__global float8u*)(p) = (v))

// db (N) += sum over the M rows of dy (M,N): one work-item per 8 adjacent columns, contiguous float8 row
// loads, rows summed in order (the order of matmul.cl's bias_backward: the same sums, bit for bit).
__kernel void bias_backward_v8(const int M, const int N, __global const float* dy, __global float* db)
{
    const int n0 = get_global_id(0) * 8;
    if (n0 >= N) return;
    if (n0 + 8 <= N) {
        float8 s = 0.0f;
        for (int m = 0; m < M; m++) s += VLD(dy + (size_t)m * N + n0);
        VST(db + n0, VLD(db + n0) + s);
    } else {
        for (int n = n0; n < N; n++) {
            float s = 0.0f;
            for (int m = 0; m < M; m++) s += dy[(size_t)m * N + n];
            db[n] += s;
        }
    }
}

// Causal attention forward and query-side backward of kernels/attention.cl (same arguments, same launch),
// with the q.k and dout.v dot products taken 4 keys at a time (4 independent float8 FMA chains; each key's
// sum in the same order as attention.cl) and the forward's softmax exps as float8 (PoCL's scalar exp is
// ~7 ns: it was 40% of the forward at T=256). The backward matches attention.cl's bit for bit; the
// forward's softmax sums its lanes in another order. -D: C, H, D, SCALE (D % 8 == 0 for float8, else one
// float at a time).
#ifdef C
#ifndef ROWS_RB
#define ROWS_RB 0
#endif
#define C3 (3 * C)
#if D % 8 == 0
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


// out (N,K) = in (K,N).T (matmul.cl's transpose, same launch arguments): one work-item per 16 (k) x 8 (n)
// block, read as 16 float8 rows, turned by two 8x8 register transposes (unpack, shuffle, 128-bit lane
// swaps) and written as 8 rows of 16 contiguous floats. Partial blocks at the edges go element by element.
// Global size (ceil(N / 8), ceil(K / 16)).
#define SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
inline void tr8(const float8 r0, const float8 r1, const float8 r2, const float8 r3, const float8 r4,
                const float8 r5, const float8 r6, const float8 r7, __global float* o, const int ldo)
{
    const float8 t0 = SHUF(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = SHUF(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t2 = SHUF(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = SHUF(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t4 = SHUF(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = SHUF(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t6 = SHUF(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = SHUF(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 s0 = SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), s1 = SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s2 = SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), s3 = SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s4 = SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), s5 = SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s6 = SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), s7 = SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    VST(o, SHUF(s0, s4, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + ldo, SHUF(s1, s5, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 2 * ldo, SHUF(s2, s6, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 3 * ldo, SHUF(s3, s7, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 4 * ldo, SHUF(s0, s4, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 5 * ldo, SHUF(s1, s5, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 6 * ldo, SHUF(s2, s6, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 7 * ldo, SHUF(s3, s7, 4, 5, 6, 7, 12, 13, 14, 15));
}

inline void transpose_blk(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                          const int ldo)
{
    const int n0 = get_global_id(0) * 8, k0 = get_global_id(1) * 16;
    if (n0 >= N || k0 >= K) return;
    if (n0 + 8 <= N && k0 + 16 <= K) {
        __global const float* p = in + (size_t)k0 * N + n0;
        for (int h = 0; h < 2; h++, p += 8 * (size_t)N)
            tr8(VLD(p), VLD(p + N), VLD(p + 2 * N), VLD(p + 3 * N), VLD(p + 4 * N), VLD(p + 5 * N),
                VLD(p + 6 * N), VLD(p + 7 * N), out + (size_t)n0 * ldo + k0 + 8 * h, ldo);
        return;
    }
    const int nk = min(16, K - k0), nn = min(8, N - n0);
    for (int n = 0; n < nn; n++)
        for (int k = 0; k < nk; k++) out[(size_t)(n0 + n) * ldo + k0 + k] = in[(size_t)(k0 + k) * N + n0 + n];
}

__kernel void transpose_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out)
{
    transpose_blk(K, N, in, out, K);
}

// transpose_v8 into rows ldo >= K floats apart (out row n at out + n * ldo; the padding is not written):
// matmul_rb's op(B) with a leading dimension off the powers of two (engine.py, ld_pad).
__kernel void transpose_ld_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                              const int ldo)
{
    transpose_blk(K, N, in, out, ldo);
}

// out (K,N), rows ldo floats apart = in (K,N) contiguous; 64 floats of a row a work-item (float8 where whole).
// Global size (ceil(N / 64), K).
__kernel void copy_ld_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                         const int ldo)
{
    const int c0 = get_global_id(0) * 64, k = get_global_id(1);
    if (c0 >= N || k >= K) return;
    __global const float* p = in + (size_t)k * N;
    __global float* o = out + (size_t)k * ldo;
    if (c0 + 64 <= N) {
#pragma unroll
        for (int j = 0; j < 64; j += 8) VST(o + c0 + j, VLD(p + c0 + j));
        return;
    }
    for (int c = c0; c < N; c++) o[c] = p[c];
}

// adamw.cl's grad_norm_partial (chunks, not STRIDED; same launch and arguments): partials[i] = sum of g[j]^2
// over chunk i, as four float8 chains (32 floats a step), the 32 lanes summed in a fixed order at the end,
// then the scalar tail. Deterministic; another order of summation than adamw.cl's.
__kernel void grad_norm_partial_v8(const int n, const int chunk, __global const float* g, __global float* partials)
{
    const int i = get_global_id(0);
    const int lo = i * chunk, hi = min(n, lo + chunk);
    float8 s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int j = lo;
    for (; j + 32 <= hi; j += 32) {
        const float8 a = VLD(g + j), b = VLD(g + j + 8), c = VLD(g + j + 16), d = VLD(g + j + 24);
        s0 += a * a; s1 += b * b; s2 += c * c; s3 += d * d;
    }
    const float8 sv = (s0 + s1) + (s2 + s3);
    const float4 h4 = sv.lo + sv.hi;
    const float2 h2 = h4.lo + h4.hi;
    float s = h2.x + h2.y;
    for (; j < hi; j++) s += g[j] * g[j];
    partials[i] = s;
}

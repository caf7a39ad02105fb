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
#endif

// ---- matmul_kb: matmul_rb of kernels/matmul.cl (same arguments, same results bit for bit: every output
// sums over k in order from 0 into one float8 lane) with the k range cut into chunks of KC. Each work-item
// owns MB blocks of RM rows x 8*NV columns; for each chunk the MB blocks run one after the other over the
// same KC x 8*NV panel of op(B), which stays in L1 (matmul_rb streams the whole K-deep panel from L2 or
// beyond for every 6 rows), their accumulators parked in a private array between chunks. With TA=1 the MB*RM
// values of op(A) a row k needs lie side by side (A[k*lda + m0 ...]): wide transposed A is read in place.
// Needs op(B) rows contiguous (TB == 0). Global size (ceil(M / (RM*MB)), ceil(N / (8 NV))).
#ifdef MMKB
#ifndef TA
#define TA 0
#endif
#ifndef BIAS
#define BIAS 0
#endif
#ifndef RESID
#define RESID 0
#endif
#ifndef ACCUM
#define ACCUM 0
#endif
#ifndef EPI
#define EPI 0
#endif
#define GELU_S 0.7978845608028654f
#if TA == 0
#define AT(m, k) A[(m) * lda + (k)]
#else
#define AT(m, k) A[(k) * lda + (m)]
#endif

__kernel void matmul_kb(const int M, const int N, const int K,
                        __global const float* restrict A, const int lda,
                        __global const float* restrict B, const int ldb,
                        __global float* Cm, const int ldc,
                        __global const float* restrict bias,
                        __global const float* R,
                        const float alpha, __global float* E)
{
    const int m0 = get_global_id(0) * (RM * MB), n0 = get_global_id(1) * (8 * NV);
    if (m0 >= M || n0 >= N) return;
    const int mbs = min(MB, (M - m0 + RM - 1) / RM);  // blocks with at least one row inside M
    if (n0 + 8 * NV <= N) {
        float8 accs[MB][RM][NV];
        for (int mb = 0; mb < MB; mb++)
            for (int i = 0; i < RM; i++)
                for (int j = 0; j < NV; j++) accs[mb][i][j] = 0.0f;
        for (int kb = 0; kb < K; kb += KC) {
            const int ke = min(K, kb + KC);
            for (int mb = 0; mb < mbs; mb++) {
                int rows[RM];  // rows past M repeat the last one; their results are not stored
#pragma unroll
                for (int i = 0; i < RM; i++) rows[i] = min(m0 + mb * RM + i, M - 1);
                float8 acc[RM][NV];
#pragma unroll
                for (int i = 0; i < RM; i++)
#pragma unroll
                    for (int j = 0; j < NV; j++) acc[i][j] = accs[mb][i][j];
                __global const float* bp = B + (size_t)kb * ldb + n0;
                for (int k = kb; k < ke; k++, bp += ldb) {
                    float8 b[NV];
#pragma unroll
                    for (int j = 0; j < NV; j++) b[j] = VLD(bp + 8 * j);
#pragma unroll
                    for (int i = 0; i < RM; i++) {
                        const float a = AT(rows[i], k);
#pragma unroll
                        for (int j = 0; j < NV; j++) acc[i][j] += a * b[j];
                    }
                }
#pragma unroll
                for (int i = 0; i < RM; i++)
#pragma unroll
                    for (int j = 0; j < NV; j++) accs[mb][i][j] = acc[i][j];
            }
        }
        for (int mb = 0; mb < mbs; mb++) {
            for (int i = 0; i < RM; i++) {
                const int gm = m0 + mb * RM + i;
                if (gm >= M) break;
#pragma unroll
                for (int j = 0; j < NV; j++) {
                    const int o = gm * ldc + n0 + 8 * j;
                    float8 c = alpha * accs[mb][i][j];
#if BIAS
                    c += VLD(bias + n0 + 8 * j);
#endif
#if RESID
                    c += VLD(R + o);
#endif
#if ACCUM
                    c += VLD(Cm + o);
#endif
#if EPI == 1
                    VST(E + o, c - c / (exp(2.0f * GELU_S * (c + 0.044715f * c * c * c)) + 1.0f));
#elif EPI == 2
                    const float8 x = VLD(E + o);
                    const float8 t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
                    c *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
#endif
                    VST(Cm + o, c);
                }
            }
        }
    } else {  // the last, partial column block: scalar, same order of summation over k
        const int nn = N - n0, me = min(M, m0 + RM * MB);
        for (int gm = m0; gm < me; gm++) {
            for (int j = 0; j < nn; j++) {
                const int gn = n0 + j, o = gm * ldc + gn;
                float s = 0.0f;
                for (int k = 0; k < K; k++) s += AT(gm, k) * B[k * ldb + gn];
                float c = alpha * s;
#if BIAS
                c += bias[gn];
#endif
#if RESID
                c += R[o];
#endif
#if ACCUM
                c += Cm[o];
#endif
#if EPI == 1
                E[o] = c - c / (exp(2.0f * GELU_S * (c + 0.044715f * c * c * c)) + 1.0f);
#elif EPI == 2
                const float x = E[o];
                const float t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
                c *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
#endif
                Cm[o] = c;
            }
        }
    }
}
#endif

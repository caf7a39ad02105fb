// Matmul (two forms: a local-memory tiled one for GPUs, a register-blocked vector one for CPUs), the
// transpose the CPU form needs, and the bias gradient.
//   matmul, matmul_rb: C (M,N) = epi(alpha * op(A) (M,K) @ op(B) (K,N) [+ bias (N)] [+ R (M,N)] [+ C])
//                  op(A)[m,k] = TA ? A[k*lda+m] : A[m*lda+k];  op(B)[k,n] = TB ? B[n*ldb+k] : B[k*ldb+n]
//                  epi: EPI 0 none; 1 also writes E (M,N) = gelu(C) (C keeps the pre-activation);
//                       2 C *= gelu'(E) (E holds the pre-activation: dh = (dy @ W) * gelu'(h))
//   transpose:     out (N,K) = in (K,N).T, both row-major and contiguous
//   bias_backward: db (N) += sum_m dy[m*N+n]
// A linear layer y = x @ W.T + b (W is (out,in)) is TA=0,TB=1; dx = dy @ W is TA=0,TB=0;
// dW += dy.T @ x is TA=1,TB=0 with ACCUM=1. Every output sums over k in order: deterministic.
// -D: TA, TB (0/1), BIAS, RESID, ACCUM (0/1), EPI (0/1/2); matmul: tile TSM x TSN x TSK, each work-item
// WPTM x WPTN outputs, LDSV=1 reads the local tiles as float4 (WPTM, WPTN multiples of 4);
// matmul_rb: RM rows x NV float8 columns per work-item.
// Sizes need not be multiples of the tiles.
#ifndef TA
#define TA 0
#endif
#ifndef TB
#define TB 0
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
#ifndef LDSV
#define LDSV 0
#endif
#ifndef TSM
#define TSM 32
#endif
#ifndef TSN
#define TSN 32
#endif
#ifndef TSK
#define TSK 16
#endif
#ifndef WPTM
#define WPTM 4
#endif
#ifndef WPTN
#define WPTN 4
#endif
#define RTSM (TSM / WPTM)
#define RTSN (TSN / WPTN)
#define NTHREADS (RTSM * RTSN)
#define GELU_S 0.7978845608028654f

// gelu(x) and gelu'(x), tanh form, tanh u = 1 - 2 / (exp(2u) + 1) as in gelu.cl
inline float gelu_f(const float x)
{
    return x - x / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
}
inline float gelu_df(const float x)
{
    const float t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
}

// The epilogue of one output: c = alpha * acc [+ bias] [+ R] [+ C], then EPI.
inline float epilogue(const float acc, const int gm, const int gn, const int ldc, __global float* Cm,
                      __global const float* bias, __global const float* R, __global float* E, const float alpha)
{
    float c = alpha * acc;
#if BIAS
    c += bias[gn];
#endif
#if RESID
    c += R[gm * ldc + gn];
#endif
#if ACCUM
    c += Cm[gm * ldc + gn];
#endif
#if EPI == 1
    E[gm * ldc + gn] = gelu_f(c);
#elif EPI == 2
    c *= gelu_df(E[gm * ldc + gn]);
#endif
    return c;
}

__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1)))
void matmul(const int M, const int N, const int K,
            __global const float* restrict A, const int lda,
            __global const float* restrict B, const int ldb,
            __global float* Cm, const int ldc,
            __global const float* restrict bias,
            __global const float* R,
            const float alpha, __global float* E)
{
    const int tn = get_local_id(0), tm = get_local_id(1);
    const int n0 = get_group_id(0) * TSN, m0 = get_group_id(1) * TSM;
    const int tid = tm * RTSN + tn;
    // +4 padding: the transposing stores into As / Bs do not all hit one bank; rows stay 16-byte aligned
    __local float As[TSK][TSM + 4] __attribute__((aligned(16)));
    __local float Bs[TSK][TSN + 4] __attribute__((aligned(16)));
    float acc[WPTM][WPTN];
    for (int i = 0; i < WPTM; i++)
        for (int j = 0; j < WPTN; j++) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += TSK) {
        for (int e = tid; e < TSK * TSM; e += NTHREADS) {
#if TA == 0
            const int m = e / TSK, k = e % TSK;
#else
            const int k = e / TSM, m = e % TSM;
#endif
            const int gm = m0 + m, gk = k0 + k;
            float a = 0.0f;
#if TA == 0
            if (gm < M && gk < K) a = A[gm * lda + gk];
#else
            if (gm < M && gk < K) a = A[gk * lda + gm];
#endif
            As[k][m] = a;
        }
        for (int e = tid; e < TSK * TSN; e += NTHREADS) {
#if TB == 0
            const int k = e / TSN, n = e % TSN;
#else
            const int n = e / TSK, k = e % TSK;
#endif
            const int gn = n0 + n, gk = k0 + k;
            float b = 0.0f;
#if TB == 0
            if (gn < N && gk < K) b = B[gk * ldb + gn];
#else
            if (gn < N && gk < K) b = B[gn * ldb + gk];
#endif
            Bs[k][n] = b;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < TSK; k++) {
            float a[WPTM], b[WPTN];
#if LDSV
            // work-item (tn, tm) owns rows tm*4 + {0..3} + i4*RTSM*4 and likewise columns
            for (int j = 0; j < WPTN / 4; j++) {
                const float4 v = *(__local const float4*)&Bs[k][(j * RTSN + tn) * 4];
                b[4 * j] = v.x; b[4 * j + 1] = v.y; b[4 * j + 2] = v.z; b[4 * j + 3] = v.w;
            }
            for (int i = 0; i < WPTM / 4; i++) {
                const float4 v = *(__local const float4*)&As[k][(i * RTSM + tm) * 4];
                a[4 * i] = v.x; a[4 * i + 1] = v.y; a[4 * i + 2] = v.z; a[4 * i + 3] = v.w;
            }
#else
            for (int j = 0; j < WPTN; j++) b[j] = Bs[k][tn + j * RTSN];
            for (int i = 0; i < WPTM; i++) a[i] = As[k][tm + i * RTSM];
#endif
            for (int i = 0; i < WPTM; i++)
                for (int j = 0; j < WPTN; j++) acc[i][j] += a[i] * b[j];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

#if LDSV
#define ROW_OF(i) (m0 + ((i) / 4 * RTSM + tm) * 4 + (i) % 4)
#define COL_OF(j) (n0 + ((j) / 4 * RTSN + tn) * 4 + (j) % 4)
#else
#define ROW_OF(i) (m0 + tm + (i) * RTSM)
#define COL_OF(j) (n0 + tn + (j) * RTSN)
#endif
    for (int i = 0; i < WPTM; i++) {
        const int gm = ROW_OF(i);
        if (gm >= M) continue;
        for (int j = 0; j < WPTN; j++) {
            const int gn = COL_OF(j);
            if (gn >= N) continue;
            Cm[gm * ldc + gn] = epilogue(acc[i][j], gm, gn, ldc, Cm, bias, R, E, alpha);
        }
    }
}

// CPU form: no local memory (the caches hold the operands), each work-item RM rows x NV*8 columns held
// as float8 accumulators, k innermost, one op(A) value broadcast against NV float8 loads of op(B).
// Needs op(B) rows contiguous: TB == 0 (the host transposes B first otherwise).
// Global size (ceil(M/RM), ceil(N/(8 NV))); the last column block may be partial (scalar path).
#ifndef RM
#define RM 6
#endif
#ifndef NV
#define NV 2
#endif
// float8 loads/stores with 4-byte alignment: plain vector access, inlined (PoCL calls vload8 out of line)
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define VLD(p) (*(__global const float8u*)(p))
#define VST(p, v) (*(__global float8u*)(p) = (v))
#if TA == 0
#define AT(m, k) A[(m) * lda + (k)]
#else
#define AT(m, k) A[(k) * lda + (m)]
#endif

__kernel void matmul_rb(const int M, const int N, const int K,
                        __global const float* restrict A, const int lda,
                        __global const float* restrict B, const int ldb,
                        __global float* Cm, const int ldc,
                        __global const float* restrict bias,
                        __global const float* R,
                        const float alpha, __global float* E)
{
    const int m0 = get_global_id(0) * RM, n0 = get_global_id(1) * (8 * NV);
    if (m0 >= M || n0 >= N) return;
    int rows[RM];  // rows past M repeat the last one; their results are not stored
#pragma unroll
    for (int i = 0; i < RM; i++) rows[i] = min(m0 + i, M - 1);
    if (n0 + 8 * NV <= N) {
        float8 acc[RM][NV];
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int j = 0; j < NV; j++) acc[i][j] = 0.0f;
        __global const float* bp = B + n0;
        for (int k = 0; k < K; k++, bp += ldb) {
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
        for (int i = 0; i < RM; i++) {
            const int gm = m0 + i;
            if (gm >= M) break;
#pragma unroll
            for (int j = 0; j < NV; j++) {
                const int o = gm * ldc + n0 + 8 * j;
                float8 c = alpha * acc[i][j];
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
    } else {  // the last, partial column block: scalar, same order of summation over k
        const int nn = N - n0;
        float acc[RM][8 * NV];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < 8 * NV; j++) acc[i][j] = 0.0f;
        for (int k = 0; k < K; k++) {
            __global const float* bp = B + k * ldb + n0;
            for (int i = 0; i < RM; i++) {
                const float a = AT(rows[i], k);
                for (int j = 0; j < nn; j++) acc[i][j] += a * bp[j];
            }
        }
        for (int i = 0; i < RM; i++) {
            const int gm = m0 + i;
            if (gm >= M) break;
            for (int j = 0; j < nn; j++)
                Cm[gm * ldc + n0 + j] = epilogue(acc[i][j], gm, n0 + j, ldc, Cm, bias, R, E, alpha);
        }
    }
}

// out (N,K) = in (K,N).T; one work-item per 8x8 block.
__kernel void transpose(const int K, const int N, __global const float* restrict in, __global float* restrict out)
{
    const int n0 = get_global_id(0) * 8, k0 = get_global_id(1) * 8;
    if (n0 >= N || k0 >= K) return;
    const int nk = min(8, K - k0), nn = min(8, N - n0);
    for (int n = 0; n < nn; n++)
        for (int k = 0; k < nk; k++) out[(n0 + n) * K + k0 + k] = in[(k0 + k) * N + n0 + n];
}

// db (N) += sum over the M rows of dy (M,N), rows summed in order.
__kernel void bias_backward(const int M, const int N, __global const float* dy, __global float* db)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    float s = 0.0f;
    for (int m = 0; m < M; m++) s += dy[m * N + n];
    db[n] += s;
}

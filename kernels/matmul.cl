// Tiled, register-blocked matmul and the bias gradient.
//   matmul:        C (M,N) = alpha * op(A) (M,K) @ op(B) (K,N) [+ bias (N)] [+ R (M,N)] [+ C]
//                  op(A)[m,k] = TA ? A[k*lda+m] : A[m*lda+k];  op(B)[k,n] = TB ? B[n*ldb+k] : B[k*ldb+n]
//   bias_backward: db (N) += sum_m dy[m*N+n]
// A linear layer y = x @ W.T + b (W is (out,in)) is TA=0,TB=1; dx = dy @ W is TA=0,TB=0;
// dW += dy.T @ x is TA=1,TB=0 with ACCUM=1.
// -D: TA, TB (0/1), BIAS, RESID, ACCUM (0/1), tile TSM x TSN x TSK, each work-item WPTM x WPTN outputs.
// Work-group (TSN/WPTN, TSM/WPTM); dimension 0 runs along n so neighbouring work-items touch
// neighbouring addresses. Sizes need not be multiples of the tiles (loads are zero-padded).
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

__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1)))
void matmul(const int M, const int N, const int K,
            __global const float* restrict A, const int lda,
            __global const float* restrict B, const int ldb,
            __global float* Cm, const int ldc,
            __global const float* restrict bias,
            __global const float* R,
            const float alpha)
{
    const int tn = get_local_id(0), tm = get_local_id(1);
    const int n0 = get_group_id(0) * TSN, m0 = get_group_id(1) * TSM;
    const int tid = tm * RTSN + tn;
    __local float As[TSK][TSM];
    __local float Bs[TSK][TSN];
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
            float b[WPTN];
            for (int j = 0; j < WPTN; j++) b[j] = Bs[k][tn + j * RTSN];
            for (int i = 0; i < WPTM; i++) {
                const float a = As[k][tm + i * RTSM];
                for (int j = 0; j < WPTN; j++) acc[i][j] += a * b[j];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    for (int i = 0; i < WPTM; i++) {
        const int gm = m0 + tm + i * RTSM;
        if (gm >= M) continue;
        for (int j = 0; j < WPTN; j++) {
            const int gn = n0 + tn + j * RTSN;
            if (gn >= N) continue;
            float c = alpha * acc[i][j];
#if BIAS
            c += bias[gn];
#endif
#if RESID
            c += R[gm * ldc + gn];
#endif
#if ACCUM
            c += Cm[gm * ldc + gn];
#endif
            Cm[gm * ldc + gn] = c;
        }
    }
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

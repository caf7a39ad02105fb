// Matmul (two forms: a local-memory tiled one for GPUs, a register-blocked vector one for CPUs), the
// transpose the CPU form needs, and the bias gradient.
//   matmul, matmul_rb: C (M,N) = epi(alpha * op(A) (M,K) @ op(B) (K,N) [+ bias (N)] [+ R (M,N)] [+ C])
//                  op(A)[m,k] = TA ? A[k*lda+m] : A[m*lda+k];  op(B)[k,n] = TB ? B[n*ldb+k] : B[k*ldb+n]
//                  epi: EPI 0 none; 1 also writes E (M,N) = gelu(C) (C keeps the pre-activation);
//                       2 C *= gelu'(E) (E holds the pre-activation: dh = (dy @ W) * gelu'(h));
//                       3 SwiGLU backward: E (M, 2N) = gate | up rows ldc (= 2N) apart, c = dact; C's row gets
//                         dgate = c u s (1 + g (1 - s)) at columns 0..N-1 and dup = c g s at N..2N-1 (s = sigmoid(g))
//   transpose:     out (N,K) = in (K,N).T, both row-major and contiguous
//   bias_backward: db (N) += sum_m dy[m*N+n]
// A linear layer y = x @ W.T + b (W is (out,in)) is TA=0,TB=1; dx = dy @ W is TA=0,TB=0;
// dW += dy.T @ x is TA=1,TB=0 with ACCUM=1. Every output sums over k in order: deterministic.
// ROUND (precision.cl): 0 fp32; 1 bf16, 2 tf32 operands (rounded as loaded, fp32 sums): the portable form of
// the tensor-core kernels in matmul_mma.cl, for every device.
// A16, B16 (matmul; bf16 storage): A (B) holds bf16 values as ushort, the top 16 bits of each float (a copy
// kernels/matmul_bf16.cl's to_bf16 wrote, rounded to nearest even by precision.cl's bf16_bits, as ROUND 1 rounds),
// lda (ldb) counted in ushorts; widened to fp32 in the tile loads. Half the bytes each tile moves from global
// memory, and the same products bit for bit as ROUND=1 on the fp32 operands (widening a rounded value is exact).
// -D: TA, TB (0/1), BIAS, RESID, ACCUM (0/1), EPI (0/1/2/3); matmul: tile TSM x TSN x TSK, each work-item
// WPTM x WPTN outputs, LDSV=1 reads the local tiles as float4 (WPTM, WPTN multiples of 4), VEC=1 loads whole
// tiles from global memory as float4 along each operand's contiguous axis (see VEC below);
// matmul_rb: RM rows x NV vectors of VW (8 or 16) columns per work-item.
// WARP=1 builds `matmul` from kernels/matmul_warp.cl instead: warp tiles, float4 operand reads, one barrier a tile.
// Sizes need not be multiples of the tiles.
#ifndef TA
#define TA 0
#endif
#ifndef TB
#define TB 0
#endif
#ifndef LDSV
#define LDSV 0
#endif
#ifndef WARP
#define WARP 0
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
#include "epilogue.cl"
#include "precision.cl"
#ifndef A16
#define A16 0
#endif
#ifndef B16
#define B16 0
#endif
// an operand element as loaded (a_t, b_t) -> the fp32 the local tile holds (A_IN, B_IN; *_IN4 four of them)
#if A16
typedef ushort a_t;
#define A_IN(x) as_float((uint)(x) << 16)
#define A_IN4(p) as_float4(convert_uint4(vload4(0, p)) << 16)
#else
typedef float a_t;
#define A_IN(x) ROUND_OP(x)
#define A_IN4(p) round_op4(vload4(0, p))
#endif
#if B16
typedef ushort b_t;
#define B_IN(x) as_float((uint)(x) << 16)
#define B_IN4(p) as_float4(convert_uint4(vload4(0, p)) << 16)
#else
typedef float b_t;
#define B_IN(x) ROUND_OP(x)
#define B_IN4(p) round_op4(vload4(0, p))
#endif
inline float4 round_op4(const float4 v) { return (float4)(ROUND_OP(v.x), ROUND_OP(v.y), ROUND_OP(v.z), ROUND_OP(v.w)); }

// Tile loads: element e (0 .. TSK*TSM-1) of the A tile at k0 -> (k, m), coalesced along A's rows in memory.
#if TA == 0
#define A_KM(e, k, m) const int m = (e) / TSK, k = (e) % TSK
#define A_AT(gm, gk) A[(gm) * lda + (gk)]
#else
#define A_KM(e, k, m) const int k = (e) / TSM, m = (e) % TSM
#define A_AT(gm, gk) A[(gk) * lda + (gm)]
#endif
#if TB == 0
#define B_KN(e, k, n) const int k = (e) / TSN, n = (e) % TSN
#define B_AT(gn, gk) B[(gk) * ldb + (gn)]
#else
#define B_KN(e, k, n) const int n = (e) / TSK, k = (e) % TSK
#define B_AT(gn, gk) B[(gn) * ldb + (gk)]
#endif
#define LA ((TSK * TSM + NTHREADS - 1) / NTHREADS)
#define LB ((TSK * TSN + NTHREADS - 1) / NTHREADS)
#ifndef PREF
#define PREF 0
#endif
#ifndef BATCH
#define BATCH 0
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#define NBUF (PREF ? 2 : 1)
// VEC=1 (GPUs: a quarter of the load instructions and address sums, CLBlast's VWM / VWN): a tile lying wholly
//   inside the operands, in a work-group whose A and B start 16-byte aligned with row strides a multiple of 4
//   floats and whose K range starts at a multiple of 4, is read as float4 along each operand's contiguous axis (k
//   for A with TA=0 and B with TB=1; m, n otherwise); other tiles take the one-float loads. The same values land
//   in the same local tiles: the sums, and their order, are those of VEC=0. Needs TSK*TSM and TSK*TSN multiples
//   of 4 * NTHREADS (each work-item a whole number of float4).
#ifndef VEC
#define VEC 0
#endif
#if VEC && ((TSK * TSM) % (4 * NTHREADS) || (TSK * TSN) % (4 * NTHREADS) || TSK % 4 || TSM % 4 || TSN % 4)
#error "VEC=1 needs TSK*TSM and TSK*TSN multiples of 4 * work-items and TSK, TSM, TSN multiples of 4"
#endif
// SPLITK=1: work-group z of dimension 2 sums k in [z*kc, min(K, (z+1)*kc)) and stores the raw sums (no alpha,
//   no epilogue) at Cm + z*M*ldc; splitk_reduce adds the parts in order of z (deterministic).
// BATCH=1: work-group z of dimension 2 offsets A, B, Cm by o + (z / HB) * s_b + (z % HB) * s_h (batch, head).
// CAUSAL (batched attention products, M = the query axis): 1 skips output tiles wholly above the diagonal
//   (n > m: the row kernels write those entries), 2 stops k at the diagonal (op(A)[m,k] = 0 for k > m),
//   3 starts k at the diagonal (op(A)[m,k] = 0 for k < m). Only zero terms are skipped.
// PREF=1: double-buffered local tiles, the next tile's global loads issued before the current tile's
//   products; one barrier a tile. Same order of summation either way.
// GROUP (mixture of experts, -DNGROUPS=E): the local-memory form of matmul_rb_grouped below (GPUs), the same
//   packed operands. Group e's rows are offs[e] .. offs[e]+counts[e]-1, offs[e] a multiple of TSM (kernels/moe.cl
//   packs them so), so a row tile never straddles two groups.
//   GROUP 1: C[rows of e] (= alpha op(A)[rows of e] @ B_e) [+ C], B_e = B + e*bstride: row tile
//            get_group_id(1) covers rows m0 .. m0+TSM-1 and finds its group (tiles in padding exit); M unused.
//   GROUP 2: work-group z = e*GS + s of dimension 2: C_e (M,N) (= alpha op(A_e) @ B_e) [+ C_e], C_e = Cm +
//            e*cstride, summing k in [s*kc, min(counts[e], (s+1)*kc)) of group e's rows (weight gradients:
//            op(A) = dY.T, TA=1). GS = 1: all of them. With SPLITK the raw sums of chunk s go to
//            Cm + (s*NGROUPS + e)*M*ldc instead (empty chunks write nothing; splitk_reduce_grouped adds them).
#if defined(GROUP)
#define EXTRA_ARGS , const int kc, const int GS, const int bstride, const int cstride, \
    __global const int* counts, __global const int* offs
#elif SPLITK || BATCH
#define EXTRA_ARGS , const int kc, const int HB, const int oA, const int sAb, const int sAh, const int oB, \
    const int sBb, const int sBh, const int oC, const int sCb, const int sCh
#else
#define EXTRA_ARGS
#endif

#if WARP  // the warp-tiled form (float4 operands, warp tiles, fma): its own file, the same contract
#include "matmul_warp.cl"
#else
__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1)))
void matmul(const int M, const int N, const int K,
            __global const a_t* restrict A, const int lda,
            __global const b_t* restrict B, const int ldb,
            __global float* Cm, const int ldc,
            __global const float* restrict bias,
            __global const float* R,
            const float alpha, __global float* E EXTRA_ARGS)
{
    const int tn = get_local_id(0), tm = get_local_id(1);
    const int2 tile = tile_of_group();
    const int n0 = tile.x * TSN, m0 = tile.y * TSM;
    const int tid = tm * RTSN + tn;
#include "gemm_offsets.cl"
#if CAUSAL == 1
    if (n0 > m0 + TSM - 1) return;
#elif CAUSAL == 2
    kend = min(kend, m0 + TSM);
#elif CAUSAL == 3
    kbeg = max(kbeg, m0 / TSK * TSK);
#endif
    // +4 padding: the transposing stores into As / Bs do not all hit one bank; rows stay 16-byte aligned
    __local float As[NBUF][TSK][TSM + 4] __attribute__((aligned(16)));
    __local float Bs[NBUF][TSK][TSN + 4] __attribute__((aligned(16)));
    float acc[WPTM][WPTN];
    for (int i = 0; i < WPTM; i++)
        for (int j = 0; j < WPTN; j++) acc[i][j] = 0.0f;
    float ra[LA], rb[LB];

#define LOAD_TILE_S(k0)                                                                 \
    for (int i = 0; i < LA; i++) {                                                      \
        const int e = tid + i * NTHREADS;                                               \
        A_KM(e, k, m);                                                                  \
        const int gm = m0 + m, gk = (k0) + k;                                           \
        ra[i] = (e < TSK * TSM && gm < mend && gk < kend) ? A_IN(A_AT(gm, gk)) : 0.0f;    \
    }                                                                                   \
    for (int i = 0; i < LB; i++) {                                                      \
        const int e = tid + i * NTHREADS;                                               \
        B_KN(e, k, n);                                                                  \
        const int gn = n0 + n, gk = (k0) + k;                                           \
        rb[i] = (e < TSK * TSN && gn < N && gk < kend) ? B_IN(B_AT(gn, gk)) : 0.0f;    \
    }
#define STORE_TILE_S(buf)                                                               \
    for (int i = 0; i < LA; i++) {                                                      \
        const int e = tid + i * NTHREADS;                                               \
        A_KM(e, k, m);                                                                  \
        if (e < TSK * TSM) As[buf][k][m] = ra[i];                                       \
    }                                                                                   \
    for (int i = 0; i < LB; i++) {                                                      \
        const int e = tid + i * NTHREADS;                                               \
        B_KN(e, k, n);                                                                  \
        if (e < TSK * TSN) Bs[buf][k][n] = rb[i];                                       \
    }
#if VEC
    // A_V / B_V(e4, k, x): the k and row / column of float4 e4 of the tile (4 along k, or 4 along m / n)
#if TA == 0
#define A_V(e4, k, m) const int m = (e4) / (TSK / 4), k = (e4) % (TSK / 4) * 4
#define A_ST(buf, k, m, v) As[buf][k][m] = v.x; As[buf][k + 1][m] = v.y; As[buf][k + 2][m] = v.z; As[buf][k + 3][m] = v.w
#else
#define A_V(e4, k, m) const int k = (e4) / (TSM / 4), m = (e4) % (TSM / 4) * 4
#define A_ST(buf, k, m, v) *(__local float4*)&As[buf][k][m] = v
#endif
#if TB == 1
#define B_V(e4, k, n) const int n = (e4) / (TSK / 4), k = (e4) % (TSK / 4) * 4
#define B_ST(buf, k, n, v) Bs[buf][k][n] = v.x; Bs[buf][k + 1][n] = v.y; Bs[buf][k + 2][n] = v.z; Bs[buf][k + 3][n] = v.w
#else
#define B_V(e4, k, n) const int k = (e4) / (TSN / 4), n = (e4) % (TSN / 4) * 4
#define B_ST(buf, k, n, v) *(__local float4*)&Bs[buf][k][n] = v
#endif
#define LOAD_TILE_V(k0)                                                                 \
    for (int i = 0; i < LA / 4; i++) {                                                  \
        A_V(tid + i * NTHREADS, k, m);                                                  \
        const float4 v = A_IN4(&A_AT(m0 + m, (k0) + k));                                \
        ra[4 * i] = v.x; ra[4 * i + 1] = v.y; ra[4 * i + 2] = v.z; ra[4 * i + 3] = v.w;  \
    }                                                                                   \
    for (int i = 0; i < LB / 4; i++) {                                                  \
        B_V(tid + i * NTHREADS, k, n);                                                  \
        const float4 v = B_IN4(&B_AT(n0 + n, (k0) + k));                                \
        rb[4 * i] = v.x; rb[4 * i + 1] = v.y; rb[4 * i + 2] = v.z; rb[4 * i + 3] = v.w;  \
    }
#define STORE_TILE_V(buf)                                                               \
    for (int i = 0; i < LA / 4; i++) {                                                  \
        A_V(tid + i * NTHREADS, k, m);                                                  \
        const float4 v = (float4)(ra[4 * i], ra[4 * i + 1], ra[4 * i + 2], ra[4 * i + 3]); \
        A_ST(buf, k, m, v);                                                             \
    }                                                                                   \
    for (int i = 0; i < LB / 4; i++) {                                                  \
        B_V(tid + i * NTHREADS, k, n);                                                  \
        const float4 v = (float4)(rb[4 * i], rb[4 * i + 1], rb[4 * i + 2], rb[4 * i + 3]); \
        B_ST(buf, k, n, v);                                                             \
    }
    // the tile at k0 as float4 where it lies wholly inside aligned operands; vl says which form the registers hold
    const int vec_ok = m0 + TSM <= mend && n0 + TSN <= N && lda % 4 == 0 && ldb % 4 == 0 && kbeg % 4 == 0
        && ((((ulong)A) | ((ulong)B)) & 15) == 0;
    int vl = 0;
#define LOAD_TILE(k0) vl = vec_ok && (k0) + TSK <= kend; if (vl) { LOAD_TILE_V(k0) } else { LOAD_TILE_S(k0) }
#define STORE_TILE(buf) if (vl) { STORE_TILE_V(buf) } else { STORE_TILE_S(buf) }
#else
#define LOAD_TILE(k0) LOAD_TILE_S(k0)
#define STORE_TILE(buf) STORE_TILE_S(buf)
#endif

    if (kbeg < kend) {
        LOAD_TILE(kbeg)
        STORE_TILE(0)
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    int cur = 0;
    for (int k0 = kbeg; k0 < kend; k0 += TSK) {
        const int nk = k0 + TSK;
#if PREF
        if (nk < kend) { LOAD_TILE(nk) }
#endif
        for (int k = 0; k < TSK; k++) {
            float a[WPTM], b[WPTN];
#if LDSV
            // work-item (tn, tm) owns rows tm*4 + {0..3} + i4*RTSM*4 and likewise columns
            for (int j = 0; j < WPTN / 4; j++) {
                const float4 v = *(__local const float4*)&Bs[cur][k][(j * RTSN + tn) * 4];
                b[4 * j] = v.x; b[4 * j + 1] = v.y; b[4 * j + 2] = v.z; b[4 * j + 3] = v.w;
            }
            for (int i = 0; i < WPTM / 4; i++) {
                const float4 v = *(__local const float4*)&As[cur][k][(i * RTSM + tm) * 4];
                a[4 * i] = v.x; a[4 * i + 1] = v.y; a[4 * i + 2] = v.z; a[4 * i + 3] = v.w;
            }
#else
            for (int j = 0; j < WPTN; j++) b[j] = Bs[cur][k][tn + j * RTSN];
            for (int i = 0; i < WPTM; i++) a[i] = As[cur][k][tm + i * RTSM];
#endif
            for (int i = 0; i < WPTM; i++)
                for (int j = 0; j < WPTN; j++) acc[i][j] += a[i] * b[j];
        }
#if PREF
        if (nk < kend) { STORE_TILE(cur ^ 1) }
        barrier(CLK_LOCAL_MEM_FENCE);
        cur ^= 1;
#else
        barrier(CLK_LOCAL_MEM_FENCE);
        if (nk < kend) {
            LOAD_TILE(nk)
            STORE_TILE(0)
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
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
        if (gm >= mend) continue;
        for (int j = 0; j < WPTN; j++) {
            const int gn = COL_OF(j);
            if (gn >= N) continue;
#if SPLITK
            Cm[gm * ldc + gn] = acc[i][j];
#else
            Cm[gm * ldc + gn] = epilogue(acc[i][j], gm, gn, ldc, Cm, bias, R, E, alpha);
#endif
        }
    }
}

#endif  // WARP

// Cm (MN) = alpha * sum_{z < S} P[z*MN + i] (in order of z) [+ Cm]: the second stage of a split-K matmul.
__kernel void splitk_reduce(const int MN, const int S, const int accum, const float alpha,
                            __global const float* P, __global float* Cm)
{
    const int i = get_global_id(0);
    if (i >= MN) return;
    float s = 0.0f;
    for (int z = 0; z < S; z++) s += P[(size_t)z * MN + i];
    float c = alpha * s;
    if (accum) c += Cm[i];
    Cm[i] = c;
}

#ifdef GROUP
// The second stage of GROUP 2 with SPLITK: C_e (MN) = alpha * sum_{s < ceil(counts[e] / kc)} P[(s*NGROUPS + e)*MN + i]
// (in order of s) [+ C_e], C_e = Cm + e*MN; one work-item per (i, e).
__kernel void splitk_reduce_grouped(const int MN, const int kc, const int accum, const float alpha,
                                    __global const int* counts, __global const float* P, __global float* Cm)
{
    const int i = get_global_id(0), e = get_global_id(1);
    if (i >= MN || e >= NGROUPS) return;
    const int S = (counts[e] + kc - 1) / kc;
    float s = 0.0f;
    for (int z = 0; z < S; z++) s += P[((size_t)z * NGROUPS + e) * MN + i];
    float c = alpha * s;
    if (accum) c += Cm[(size_t)e * MN + i];
    Cm[(size_t)e * MN + i] = c;
}
#endif

// CPU form: no local memory (the caches hold the operands), each work-item RM rows x NV*8 columns held
// as VW-float vector accumulators, k innermost, one op(A) value broadcast against NV vector loads of op(B).
// Needs op(B) rows contiguous: TB == 0 (the host transposes B first otherwise).
// Global size (ceil(M/RM), ceil(N/(8 NV))); the last column block may be partial (scalar path).
#ifndef RM
#define RM 6
#endif
#ifndef NV
#define NV 2
#endif
#ifndef VW  // floats per vector: NV vectors of VW columns per work-item
#define VW 8
#endif
#ifndef PREFETCH  // 1: the epilogue's operand lines are prefetched before the k loop (EPI 2, RESID, ACCUM)
#define PREFETCH 0
#endif
#ifndef INIT  // 1: the accumulators start from R (M,N; rows ldc apart): the raw sums of the k before this launch's
#define INIT 0  // (a product split along K, Ops._matmul_rb: the same chain of sums as one launch; RESID must be 0)
#endif
#if INIT && RESID
#error "INIT reads its partial sums through R: RESID must be 0"
#endif
#if PREFETCH && !defined(__x86_64__)  // __builtin_prefetch is a CPU (x86) compiler's; elsewhere (NVIDIA) none
#undef PREFETCH
#define PREFETCH 0
#endif
// VW-float vectors (VW 8 or 16; 16 fills an AVX-512 register) with 4-byte alignment: plain vector access,
// inlined (PoCL calls vload8 out of line)
#if VW == 16
typedef float16 floatv;
typedef float floatvu __attribute__((ext_vector_type(16), aligned(4)));
#define ROUND_OPV(x) ROUND_OP16(x)
#else
typedef float8 floatv;
typedef float floatvu __attribute__((ext_vector_type(8), aligned(4)));
#define ROUND_OPV(x) ROUND_OP8(x)
#endif
#define VLD(p) (*(__global const floatvu*)(p))
#define VST(p, v) (*(__global floatvu*)(p) = (v))
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
    const int m0 = get_global_id(0) * RM, n0 = get_global_id(1) * (VW * NV);
    if (m0 >= M || n0 >= N) return;
    int rows[RM];  // rows past M repeat the last one; their results are not stored
#pragma unroll
    for (int i = 0; i < RM; i++) rows[i] = min(m0 + i, M - 1);
    if (n0 + VW * NV <= N) {
        floatv acc[RM][NV];
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int j = 0; j < NV; j++) acc[i][j] = INIT ? VLD(R + rows[i] * ldc + n0 + VW * j) : 0.0f;
        __global const float* bp = B + n0;
#if PREFETCH && (EPI >= 2 || RESID || ACCUM)
        // the epilogue's loads (E, R or Cm: rows ldc apart) start now, under the k loop, not after it
#pragma unroll
        for (int i = 0; i < RM; i++) {
#if EPI >= 2
            __builtin_prefetch(E + rows[i] * ldc + n0);
#elif RESID
            __builtin_prefetch(R + rows[i] * ldc + n0);
#else
            __builtin_prefetch(Cm + rows[i] * ldc + n0);
#endif
        }
#endif
#if TA == 0
        // each row of A through its own pointer (scalar addressing: indexing with rows[i] * lda + k had the
        // compiler build the addresses in vector registers, on the ports the FMAs need; 768x128x512: 1.3 -> 0.8 ms)
        __global const float* ap[RM];
#pragma unroll
        for (int i = 0; i < RM; i++) ap[i] = A + rows[i] * lda;
#endif
        for (int k = 0; k < K; k++, bp += ldb) {
            floatv b[NV];
#pragma unroll
            for (int j = 0; j < NV; j++) b[j] = ROUND_OPV(VLD(bp + VW * j));
#pragma unroll
            for (int i = 0; i < RM; i++) {
#if TA == 0
                const float a = ROUND_OP(ap[i][k]);
#else
                const float a = ROUND_OP(AT(rows[i], k));
#endif
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
                const int o = gm * ldc + n0 + VW * j;
                floatv c = alpha * acc[i][j];
#if BIAS
                c += VLD(bias + n0 + VW * j);
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
                const floatv x = VLD(E + o);
                const floatv t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
                c *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
#elif EPI == 3
                const floatv gv = VLD(E + o), uv = VLD(E + o + N);
                const floatv sg = 1.0f / (1.0f + exp(-gv));
                VST(Cm + o + N, c * gv * sg);
                c = c * uv * sg * (1.0f + gv * (1.0f - sg));
#endif
                VST(Cm + o, c);
            }
        }
    } else {  // the last, partial column block: scalar, same order of summation over k
        const int nn = N - n0;
        float acc[RM][VW * NV];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < VW * NV; j++) acc[i][j] = INIT && j < nn ? R[rows[i] * ldc + n0 + j] : 0.0f;
        for (int k = 0; k < K; k++) {
            __global const float* bp = B + k * ldb + n0;
            for (int i = 0; i < RM; i++) {
                const float a = ROUND_OP(AT(rows[i], k));
                for (int j = 0; j < nn; j++) acc[i][j] += a * ROUND_OP(bp[j]);
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

#ifdef GROUP
// Grouped products for mixture of experts (the matmul_rb form, -DGROUP=1 or 2, -DNGROUPS=E): E groups in one launch,
// group e's rows packed at offs[e] .. offs[e]+counts[e]-1 of the row-major operands (offs[e] a multiple of RM,
// kernels/moe.cl), its matrix at B + e*bstride (GROUP 1) or its output at Cm + e*cstride (GROUP 2).
//   GROUP 1: C[rows of e] (= alpha op(A)[rows of e] @ B_e) [+ C]: tiles of RM rows; tiles[e] .. tiles[e+1]-1
//            are group e's (tiles: E+1 entries); global size (>= tiles[E], ceil(N/(8 NV))); M unused.
//   GROUP 2: C_e (M,N) (= alpha op(A_e) @ B_e) [+ C_e] with K = counts[e] rows of A_e and B_e from offs[e]
//            (weight gradients: op(A) = dY.T read in place with TA=1); global size (ceil(M/RM), ., E); KG unused.
//   GROUP 1 takes K = KG.
// Summation over k in increasing order, one work-item per output block: deterministic.
__kernel void matmul_rb_grouped(const int M, const int N, const int KG, __global const float* restrict A, const int lda,
                                __global const float* restrict B, const int ldb, const int bstride,
                                __global float* Cm, const int ldc, const int cstride, const float alpha,
                                __global const int* counts, __global const int* offs, __global const int* tiles)
{
    const int n0 = get_global_id(1) * (VW * NV);
    if (n0 >= N) return;
#if GROUP == 1
    const int t = get_global_id(0);
    int e = 0;
    while (e < NGROUPS && tiles[e + 1] <= t) e++;
    if (e >= NGROUPS) return;
    const int m0 = offs[e] + (t - tiles[e]) * RM, mend = offs[e] + counts[e], K = KG;
    B += e * bstride;
#else
    const int e = get_global_id(2), m0 = get_global_id(0) * RM, mend = M, K = counts[e];
    if (m0 >= M) return;
#if TA == 0
    A += offs[e];
#else
    A += offs[e] * lda;
#endif
    B += offs[e] * ldb;
    Cm += e * cstride;
#endif
    int rows[RM];  // rows past the group's end repeat its last one; their results are not stored
#pragma unroll
    for (int i = 0; i < RM; i++) rows[i] = min(m0 + i, mend - 1);
    if (n0 + VW * NV <= N) {
        floatv acc[RM][NV];
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int j = 0; j < NV; j++) acc[i][j] = 0.0f;
        __global const float* bp = B + n0;
#if TA == 0
        __global const float* ap[RM];  // as matmul_rb: scalar addressing of A's rows
#pragma unroll
        for (int i = 0; i < RM; i++) ap[i] = A + rows[i] * lda;
#endif
        for (int k = 0; k < K; k++, bp += ldb) {
            floatv b[NV];
#pragma unroll
            for (int j = 0; j < NV; j++) b[j] = VLD(bp + VW * j);
#pragma unroll
            for (int i = 0; i < RM; i++) {
#if TA == 0
                const float a = ap[i][k];
#else
                const float a = AT(rows[i], k);
#endif
#pragma unroll
                for (int j = 0; j < NV; j++) acc[i][j] += a * b[j];
            }
        }
#pragma unroll
        for (int i = 0; i < RM; i++) {
            if (m0 + i >= mend) break;
#pragma unroll
            for (int j = 0; j < NV; j++) {
                const int o = (m0 + i) * ldc + n0 + VW * j;
                floatv c = alpha * acc[i][j];
#if ACCUM
                c += VLD(Cm + o);
#endif
                VST(Cm + o, c);
            }
        }
    } else {
        const int nn = N - n0;
        float acc[RM][VW * NV];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < VW * NV; j++) acc[i][j] = 0.0f;
        for (int k = 0; k < K; k++) {
            __global const float* bp = B + k * ldb + n0;
            for (int i = 0; i < RM; i++) {
                const float a = AT(rows[i], k);
                for (int j = 0; j < nn; j++) acc[i][j] += a * bp[j];
            }
        }
        for (int i = 0; i < RM; i++) {
            if (m0 + i >= mend) break;
            for (int j = 0; j < nn; j++) {
                const int o = (m0 + i) * ldc + n0 + j;
#if ACCUM
                Cm[o] += alpha * acc[i][j];
#else
                Cm[o] = alpha * acc[i][j];
#endif
            }
        }
    }
}
#endif

// The warp-tiled form of matmul (-D WARP=1: kernels/matmul.cl builds this body as its `matmul`), after CLBlast's
// xgemm and CUTLASS's SIMT SGEMM: the same contract, arguments and options as matmul.cl's tiled form
// (TA, TB, BIAS, RESID, ACCUM, EPI, ROUND, A16, B16, SPLITK, BATCH, CAUSAL, GROUP: see matmul.cl), any sizes.
//   C (M,N) = epi(alpha * op(A) (M,K) @ op(B) (K,N) [+ bias] [+ R] [+ C])
// Tiles TSM x TSN x TSK a work-group of (TSN/WPTN) x (TSM/WPTM) work-items, WPTM x WPTN outputs each:
// - warp tiles: work-items 32 at a time (a warp; the layout is right for any width, its bank pattern is NVIDIA's and
//   AMD's half-wave) hold a WM x WN block of the output, WTN = WARPN lanes along n by WTM = 32 / WARPN along m; a
//   lane's outputs are WPTM/4 x WPTN/4 blocks of 4 x 4, WTM*4 rows and WTN*4 columns apart. Each k, a quarter warp
//   reads B as 8 consecutive float4 (one pass through the banks) and A as one float4 (a broadcast).
// - A is stored k-major in local memory (As[k][m], as B: Bs[k][n]), so both operands are read as float4;
//   rows TSM + 4 (TSN + 4) floats long: the transposing stores of a k-contiguous operand (A with TA=0, B with TB=1)
//   spread over the banks and rows stay 16-byte aligned.
// - two local buffers and the next tile's global loads held in registers while the current tile is consumed: one
//   barrier a tile. Global loads are float4 along each operand's contiguous axis for tiles wholly inside aligned
//   operands (the edge tiles, and unaligned operands, take guarded one-float loads into the same registers).
// - the accumulation is fma(a, b, acc), k in increasing order for every output: deterministic, and one rounding
//   a product on every device (no reliance on the compiler contracting a * b + acc).
// - the outputs of a lane come in runs of 4 columns: stored as float4 where aligned (the epilogue per element
//   otherwise, and always for EPI 3).
// Included by matmul.cl, which includes epilogue.cl and precision.cl and defines the options' defaults (tiles,
// layouts, BATCH, CAUSAL) and a_t, b_t (float, or ushort with A16 / B16 for bf16 storage) before it.
// -D: TSM, TSN, TSK, WPTM, WPTN (multiples of 4), WARPN (8 default, 32 / WARPN lanes along m) with
// TSM % (WPTM * 32 / WARPN) == 0 and TSN % (WPTN * WARPN) == 0 (clgpt/device/tuner.py's fits checks it).
#ifndef WARPN
#define WARPN 8
#endif
#define W_RTSM (TSM / WPTM)
#define W_RTSN (TSN / WPTN)
#define W_NT (W_RTSM * W_RTSN)
#define W_WTM (32 / WARPN)
#define W_WM (W_WTM * WPTM)  // a warp's rows and columns
#define W_WN (WARPN * WPTN)
#define W_PAD 4
#if WPTM % 4 || WPTN % 4 || TSK % 4 || TSM % W_WM || TSN % W_WN || W_NT % 32 || 32 % WARPN
#error "matmul_warp.cl: WPTM, WPTN, TSK multiples of 4, whole warp tiles (TSM % (WPTM*32/WARPN), TSN % (WPTN*WARPN))"
#endif
// float4 slots of a tile and per work-item (the last round may be partial)
#define W_NA4 (TSK * TSM / 4)
#define W_NB4 (TSK * TSN / 4)
#define W_LA4 ((W_NA4 + W_NT - 1) / W_NT)
#define W_LB4 ((W_NB4 + W_NT - 1) / W_NT)

#if defined(GROUP)
#define W_EXTRA_ARGS , const int kc, const int GS, const int bstride, const int cstride, \
    __global const int* counts, __global const int* offs
#elif SPLITK || BATCH
#define W_EXTRA_ARGS , const int kc, const int HB, const int oA, const int sAb, const int sAh, const int oB, \
    const int sBb, const int sBh, const int oC, const int sCb, const int sCh
#else
#define W_EXTRA_ARGS
#endif

// Slot s of a tile: float4 e4 = tid + s * W_NT. A with TA=0 (k contiguous): row m = e4 / (TSK/4), k = e4 % (TSK/4) * 4;
// with TA=1 (m contiguous): k = e4 / (TSM/4), m = e4 % (TSM/4) * 4. Likewise B (n for m, TB=1 k-contiguous).
#if TA == 0
#define W_A_SLOT(e4, k, m) const int m = (e4) / (TSK / 4), k = (e4) % (TSK / 4) * 4
#define W_A_IDX(gm, gk) ((gm) * lda + (gk))
#define W_A_STEP TSK  // the slot's address moves this much a tile
#define W_A_DK(i) (i)  // element i of a slot's float4: k + W_A_DK(i), m + W_A_DM(i)
#define W_A_DM(i) 0
#else
#define W_A_SLOT(e4, k, m) const int k = (e4) / (TSM / 4), m = (e4) % (TSM / 4) * 4
#define W_A_IDX(gm, gk) ((gk) * lda + (gm))
#define W_A_STEP (TSK * lda)
#define W_A_DK(i) 0
#define W_A_DM(i) (i)
#endif
#if TB == 1
#define W_B_SLOT(e4, k, n) const int n = (e4) / (TSK / 4), k = (e4) % (TSK / 4) * 4
#define W_B_IDX(gn, gk) ((gn) * ldb + (gk))
#define W_B_STEP TSK
#define W_B_DK(i) (i)
#define W_B_DN(i) 0
#else
#define W_B_SLOT(e4, k, n) const int k = (e4) / (TSN / 4), n = (e4) % (TSN / 4) * 4
#define W_B_IDX(gn, gk) ((gk) * ldb + (gn))
#define W_B_STEP (TSK * ldb)
#define W_B_DK(i) 0
#define W_B_DN(i) (i)
#endif

// An operand's four consecutive elements at p, 16-byte aligned (8 for bf16 storage), as the local tile holds them;
// and one element (W_A_IN, W_B_IN). A16, B16 (bf16 storage, matmul.cl's a_t, b_t): ushort values widened to fp32,
// the same values ROUND=1 makes of the fp32 operands, so the same products bit for bit.
inline float4 w_round4(const float4 v)
{
    return (float4)(ROUND_OP(v.x), ROUND_OP(v.y), ROUND_OP(v.z), ROUND_OP(v.w));
}
#if A16
#define W_A_LD4(p) as_float4(convert_uint4(*(__global const ushort4*)(p)) << 16)
#define W_A_IN(x) as_float((uint)(x) << 16)
#else
#define W_A_LD4(p) w_round4(*(__global const float4*)(p))
#define W_A_IN(x) ROUND_OP(x)
#endif
#if B16
#define W_B_LD4(p) as_float4(convert_uint4(*(__global const ushort4*)(p)) << 16)
#define W_B_IN(x) as_float((uint)(x) << 16)
#else
#define W_B_LD4(p) w_round4(*(__global const float4*)(p))
#define W_B_IN(x) ROUND_OP(x)
#endif

__kernel __attribute__((reqd_work_group_size(W_RTSN, W_RTSM, 1)))
void matmul(const int M, const int N, const int K,
            __global const a_t* restrict A, const int lda,
            __global const b_t* restrict B, const int ldb,
            __global float* Cm, const int ldc,
            __global const float* restrict bias,
            __global const float* R,
            const float alpha, __global float* E W_EXTRA_ARGS)
{
    const int tid = get_local_id(1) * W_RTSN + get_local_id(0);
    const int2 tile = tile_of_group();
    const int n0 = tile.x * TSN, m0 = tile.y * TSM;
#include "gemm_offsets.cl"
#if CAUSAL == 1
    // a tile wholly above the diagonal sums and stores nothing; its work-items still meet the barriers (PoCL 3.0
    // corrupted the rows of other tiles, and its heap, when a work-group returned here: Oclgrind found no fault)
    const int above = n0 > m0 + TSM - 1;
    if (above) kend = kbeg;
#elif CAUSAL == 2
    kend = min(kend, m0 + TSM);
#elif CAUSAL == 3
    kbeg = max(kbeg, m0 / TSK * TSK);
#endif
    __local float As[2][TSK][TSM + W_PAD] __attribute__((aligned(16)));
    __local float Bs[2][TSK][TSN + W_PAD] __attribute__((aligned(16)));

    // this work-item's outputs: rows lm + (i/4) * W_WTM*4 + i%4, columns ln + (j/4) * WARPN*4 + j%4 of the tile
    const int warp = tid / 32, lane = tid % 32;
    const int lm = warp / (TSN / W_WN) * W_WM + lane / WARPN * 4;
    const int ln = warp % (TSN / W_WN) * W_WN + lane % WARPN * 4;

    // each slot's operand index at kbeg (advanced W_*_STEP a tile) and its place in the tile
    int ia[W_LA4], ib[W_LB4];
    float4 ra[W_LA4], rb[W_LB4];
#pragma unroll
    for (int s = 0; s < W_LA4; s++) {
        W_A_SLOT(tid + s * W_NT, k, m);
        ia[s] = W_A_IDX(m0 + m, kbeg + k);
    }
#pragma unroll
    for (int s = 0; s < W_LB4; s++) {
        W_B_SLOT(tid + s * W_NT, k, n);
        ib[s] = W_B_IDX(n0 + n, kbeg + k);
    }
    // tiles wholly inside the operands, both 16-byte aligned with row strides a multiple of 4 elements and the K
    // range starting at a multiple of 4, load 4 elements at a time
    const int inner = m0 + TSM <= mend && n0 + TSN <= N && lda % 4 == 0 && ldb % 4 == 0 && kbeg % 4 == 0
        && ((((ulong)A) | ((ulong)B)) & 15) == 0;

#define W_LOAD(k0)                                                                                          \
    if (inner && (k0) + TSK <= kend) {                                                                      \
        for (int s = 0; s < W_LA4; s++)                                                                     \
            if (W_NA4 % W_NT == 0 || tid + s * W_NT < W_NA4) ra[s] = W_A_LD4(A + ia[s]); \
        for (int s = 0; s < W_LB4; s++)                                                                     \
            if (W_NB4 % W_NT == 0 || tid + s * W_NT < W_NB4) rb[s] = W_B_LD4(B + ib[s]); \
    } else {                                                                                                \
        for (int s = 0; s < W_LA4; s++) {                                                                   \
            W_A_SLOT(tid + s * W_NT, k, m);                                                                 \
            float v[4];                                                                                     \
            for (int i = 0; i < 4; i++) {                                                                   \
                const int gk = (k0) + k + W_A_DK(i), gm = m0 + m + W_A_DM(i);                               \
                v[i] = (tid + s * W_NT < W_NA4 && gm < mend && gk < kend) ? W_A_IN(A[W_A_IDX(gm, gk)]) : 0.0f; \
            }                                                                                               \
            ra[s] = (float4)(v[0], v[1], v[2], v[3]);                                                       \
        }                                                                                                   \
        for (int s = 0; s < W_LB4; s++) {                                                                   \
            W_B_SLOT(tid + s * W_NT, k, n);                                                                 \
            float v[4];                                                                                     \
            for (int i = 0; i < 4; i++) {                                                                   \
                const int gk = (k0) + k + W_B_DK(i), gn = n0 + n + W_B_DN(i);                               \
                v[i] = (tid + s * W_NT < W_NB4 && gn < N && gk < kend) ? W_B_IN(B[W_B_IDX(gn, gk)]) : 0.0f; \
            }                                                                                               \
            rb[s] = (float4)(v[0], v[1], v[2], v[3]);                                                       \
        }                                                                                                   \
    }                                                                                                       \
    for (int s = 0; s < W_LA4; s++) ia[s] += W_A_STEP;                                                      \
    for (int s = 0; s < W_LB4; s++) ib[s] += W_B_STEP;

#if TA == 0  // k-contiguous float4: four stores down a column of As
#define W_STORE_A(buf, s, k, m) As[buf][k][m] = ra[s].x; As[buf][(k) + 1][m] = ra[s].y; \
    As[buf][(k) + 2][m] = ra[s].z; As[buf][(k) + 3][m] = ra[s].w
#else
#define W_STORE_A(buf, s, k, m) *(__local float4*)&As[buf][k][m] = ra[s]
#endif
#if TB == 1
#define W_STORE_B(buf, s, k, n) Bs[buf][k][n] = rb[s].x; Bs[buf][(k) + 1][n] = rb[s].y; \
    Bs[buf][(k) + 2][n] = rb[s].z; Bs[buf][(k) + 3][n] = rb[s].w
#else
#define W_STORE_B(buf, s, k, n) *(__local float4*)&Bs[buf][k][n] = rb[s]
#endif
#define W_STORE(buf)                                                                                        \
    for (int s = 0; s < W_LA4; s++) {                                                     \
        W_A_SLOT(tid + s * W_NT, k, m);                                                                     \
        if (W_NA4 % W_NT == 0 || tid + s * W_NT < W_NA4) { W_STORE_A(buf, s, k, m); }                       \
    }                                                                                                       \
    for (int s = 0; s < W_LB4; s++) {                                                                       \
        W_B_SLOT(tid + s * W_NT, k, n);                                                                     \
        if (W_NB4 % W_NT == 0 || tid + s * W_NT < W_NB4) { W_STORE_B(buf, s, k, n); }                       \
    }

    float acc[WPTM][WPTN];
#pragma unroll
    for (int i = 0; i < WPTM; i++)
#pragma unroll
        for (int j = 0; j < WPTN; j++) acc[i][j] = 0.0f;

    if (kbeg < kend) {
        W_LOAD(kbeg)
        W_STORE(0)
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    int cur = 0;
    for (int k0 = kbeg; k0 < kend; k0 += TSK) {
        const int more = k0 + TSK < kend;
        if (more) { W_LOAD(k0 + TSK) }
        __local const float* as = &As[cur][0][lm];
        __local const float* bs = &Bs[cur][0][ln];
#pragma unroll
        for (int k = 0; k < TSK; k++) {
            float a[WPTM], b[WPTN];
#pragma unroll
            for (int i = 0; i < WPTM / 4; i++) {
                const float4 v = *(__local const float4*)(as + k * (TSM + W_PAD) + i * W_WTM * 4);
                a[4 * i] = v.x; a[4 * i + 1] = v.y; a[4 * i + 2] = v.z; a[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int j = 0; j < WPTN / 4; j++) {
                const float4 v = *(__local const float4*)(bs + k * (TSN + W_PAD) + j * WARPN * 4);
                b[4 * j] = v.x; b[4 * j + 1] = v.y; b[4 * j + 2] = v.z; b[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < WPTM; i++)
#pragma unroll
                for (int j = 0; j < WPTN; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);
        }
        if (more) { W_STORE(cur ^ 1) }
        barrier(CLK_LOCAL_MEM_FENCE);
        cur ^= 1;
    }

    // the outputs, 4 columns at a time: float4 where the run lies inside and every array it touches is aligned
    const int v4 = ldc % 4 == 0 && (((ulong)Cm) & 15) == 0
#if BIAS
        && (((ulong)bias) & 15) == 0
#endif
#if RESID
        && (((ulong)R) & 15) == 0
#endif
#if EPI == 1 || EPI == 2
        && (((ulong)E) & 15) == 0
#endif
        ;
#pragma unroll
    for (int i = 0; i < WPTM; i++) {
        const int gm = m0 + lm + i / 4 * W_WTM * 4 + i % 4;
#if CAUSAL == 1
        if (above) break;
#endif
        if (gm >= mend) continue;
#pragma unroll
        for (int j = 0; j < WPTN / 4; j++) {
            const int gn = n0 + ln + j * WARPN * 4;
            const float4 c = (float4)(acc[i][4 * j], acc[i][4 * j + 1], acc[i][4 * j + 2], acc[i][4 * j + 3]);
            __global float* o = Cm + (size_t)gm * ldc + gn;
#if EPI != 3
            if (v4 && gn + 3 < N) {
#if SPLITK
                *(__global float4*)o = c;
#else
                const size_t oi = (size_t)gm * ldc + gn;
                float4 bv = 0.0f, rv = 0.0f, cv = 0.0f, ev = 0.0f;
#if BIAS
                bv = *(__global const float4*)(bias + gn);
#endif
#if RESID
                rv = *(__global const float4*)(R + oi);
#endif
#if ACCUM
                cv = *(__global const float4*)o;
#endif
#if EPI == 2
                ev = *(__global const float4*)(E + oi);
#endif
                const float4 y = epilogue4(c, bv, rv, cv, ev, alpha);
#if EPI == 1
                *(__global float4*)(E + oi) = (float4)(gelu_f(y.x), gelu_f(y.y), gelu_f(y.z), gelu_f(y.w));
#endif
                *(__global float4*)o = y;
#endif
                continue;
            }
#endif
#pragma unroll
            for (int q = 0; q < 4; q++) {
                if (gn + q < N) {
#if SPLITK
                    o[q] = acc[i][4 * j + q];
#else
                    o[q] = epilogue(acc[i][4 * j + q], gm, gn + q, ldc, Cm, bias, R, E, alpha);
#endif
                }
            }
        }
    }
}

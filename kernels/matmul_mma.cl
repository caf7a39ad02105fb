// Matmul on NVIDIA tensor cores (sm_80+) through inline PTX mma.sync; the same contract as matmul.cl's
// `matmul` (op(A), op(B), alpha, bias, R, ACCUM, EPI, SPLITK, BATCH, CAUSAL: see there) with operands
// rounded as precision.cl rounds them and fp32 accumulators:
//   ROUND 1: bf16 operands, mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
//   ROUND 2: tf32 operands, mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
// The portable form (matmul.cl with the same ROUND) gives the same products; the tensor cores sum each
// 16 (bf16) or 8 (tf32) products in their own order, so the two agree to fp32 summation, not bit for bit.
//
// Work-group: WM x WN warps (1-D local size 32*WM*WN), output tile BM x BN, each warp (BM/WM) x (BN/WN)
// as MT x NT mma tiles of 16 x 8. K goes in tiles of 16 words per row: 32 bf16 (two per 32-bit word) or
// 16 tf32, staged from global memory (fp32) into registers, rounded, and stored in local memory, two
// buffers (the next tile's loads are issued before the current tile's products; one barrier a tile).
// Local rows are k-contiguous for both operands: As[m][word], Bs[n][word]. Within each 8-word group the
// words a thread's fragment needs (t and t+4, t = lane % 4) sit side by side, so one 64-bit load fetches
// them; pairs are XOR-swizzled by bit 1 of the row so a half-warp's 64-bit loads hit distinct banks.
// Fragment layout (PTX ISA, mma.m16n8k16 / m16n8k8; g = lane / 4): A word t of rows g, g + 8 and word
// t + 4 of the same rows; B word t and t + 4 of column g; C (g, 2t..2t+1) and (g + 8, 2t..2t+1).
// -D: TA TB BIAS RESID ACCUM EPI SPLITK BATCH CAUSAL as matmul.cl; ROUND (1 or 2); BM BN WM WN;
// ALIGN4 = 1 when k-contiguous operand rows may be read as float4 (ld and offsets multiples of 4).
// GROUP (mixture of experts, -DNGROUPS=E): matmul.cl's GROUP forms and arguments with BM for its TSM (group
//   offsets multiples of BM: a row tile never straddles two groups); GROUP 2's SPLITK chunks go to
//   splitk_reduce_grouped (kernels/matmul.cl), its kc a multiple of 4 where ALIGN4 (float4 rows stay aligned).
#ifndef TA
#define TA 0
#endif
#ifndef TB
#define TB 0
#endif
#ifndef BATCH
#define BATCH 0
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef ROUND
#define ROUND 1
#endif
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
#ifndef MMA_EMULATE
#define MMA_EMULATE 0
#endif
#ifndef ALIGN4
#define ALIGN4 0
#endif
#include "epilogue.cl"
#include "precision.cl"

#define NTH (WM * WN * 32)
#define MT (BM / WM / 16)
#define NT (BN / WN / 8)
#define KW 16                     // 32-bit words per staged row
#define KPW (ROUND == 1 ? 2 : 1)  // k values per word
#define BK (KW * KPW)             // k values per tile
// word w of row r -> its place in the local row (see the header): pair (w/8)*4 + w%4, swizzled, half w/4 % 2
#define PHYS(r, w) ((r) * KW + ((((w) >> 3) * 4 + ((w) & 3)) ^ ((((r) >> 1) & 1) << 2)) * 2 + (((w) >> 2) & 1))

#define TO_WORD(x) as_uint(round_tf32(x))                       // one tf32

// The staging of one operand tile: R rows (BM or BN) x BK k values, rows r0.., k from k0, from X (ld).
// KC = 1: element (r, k) at X[r*ld + k] (k-contiguous: float4 loads along k); KC = 0: at X[k*ld + r].
#define KC_A (TA == 0)
#define KC_B (TB == 1)
#define CH(R, KC) ((KC) ? (R) * BK / 4 / NTH : (R) * KW / NTH)  // float4 chunks or words per work-item
#define NRA (CH(BM, KC_A) * (KC_A ? 4 : KPW))                   // floats held per work-item
#define NRB (CH(BN, KC_B) * (KC_B ? 4 : KPW))

// Global -> registers (fp32, zero outside the matrix and past kend). Words of the KC = 0 form: lanes
// 0..7 take 8 consecutive rows (32 bytes of one k row), lanes 8..31 the next 3 words. Macros, not
// functions: reg must stay in registers (a function taking it by pointer, if not inlined, puts it on
// the stack).
#define LOAD_TILE(X, ld, KC, R, r0, rows, k0, reg)                                              \
    if (KC) {                                                                                   \
        _Pragma("unroll") for (int i = 0; i < (R) * BK / 4 / NTH; i++) {                        \
            const int e = tid + i * NTH, r = e / (BK / 4), c = e % (BK / 4);                     \
            const int gr = (r0) + r, gk = (k0) + 4 * c;                                          \
            float4 v = (float4)(0.0f);                                                          \
            if (gr < (rows)) {                                                                  \
                __global const float* p = (X) + (size_t)gr * (ld) + gk;                          \
                if (ALIGN4 && gk + 3 < kend) v = *(__global const float4*)p;                     \
                else {                                                                          \
                    if (gk < kend) v.x = p[0];                                                  \
                    if (gk + 1 < kend) v.y = p[1];                                              \
                    if (gk + 2 < kend) v.z = p[2];                                              \
                    if (gk + 3 < kend) v.w = p[3];                                              \
                }                                                                               \
            }                                                                                   \
            reg[4 * i] = v.x; reg[4 * i + 1] = v.y; reg[4 * i + 2] = v.z; reg[4 * i + 3] = v.w; \
        }                                                                                       \
    } else {                                                                                    \
        _Pragma("unroll") for (int i = 0; i < (R) * KW / NTH; i++) {                            \
            const int e = tid + i * NTH;                                                        \
            const int r = (e & 7) + 8 * ((e >> 5) % ((R) / 8)), w = ((e >> 3) & 3) + 4 * (e / (4 * (R))); \
            const int gr = (r0) + r;                                                            \
            _Pragma("unroll") for (int h = 0; h < KPW; h++) {                                   \
                const int gk = (k0) + w * KPW + h;                                              \
                reg[KPW * i + h] = (gr < (rows) && gk < kend) ? (X)[(size_t)gk * (ld) + gr] : 0.0f; \
            }                                                                                   \
        }                                                                                       \
    }

// Registers -> local words (rounded).
#define STORE_TILE(Xs, KC, R, reg)                                                              \
    if (KC) {                                                                                   \
        _Pragma("unroll") for (int i = 0; i < (R) * BK / 4 / NTH; i++) {                        \
            const int e = tid + i * NTH, r = e / (BK / 4), c = e % (BK / 4);                     \
            if (ROUND == 1) {                                                                   \
                (Xs)[PHYS(r, 2 * c)] = bf16x2(reg[4 * i], reg[4 * i + 1]);                        \
                (Xs)[PHYS(r, 2 * c + 1)] = bf16x2(reg[4 * i + 2], reg[4 * i + 3]);                \
            } else {                                                                            \
                _Pragma("unroll") for (int h = 0; h < 4; h++)                                   \
                    (Xs)[PHYS(r, 4 * c + h)] = TO_WORD(reg[4 * i + h]);                          \
            }                                                                                   \
        }                                                                                       \
    } else {                                                                                    \
        _Pragma("unroll") for (int i = 0; i < (R) * KW / NTH; i++) {                            \
            const int e = tid + i * NTH;                                                        \
            const int r = (e & 7) + 8 * ((e >> 5) % ((R) / 8)), w = ((e >> 3) & 3) + 4 * (e / (4 * (R))); \
            (Xs)[PHYS(r, w)] = (ROUND == 1) ? bf16x2(reg[2 * i], reg[2 * i + 1]) : TO_WORD(reg[i]); \
        }                                                                                       \
    }

#if !MMA_EMULATE
// d (4 floats) += a (16 x k) @ b (k x 8), one warp. alo = (word t, word t+4) of row g, ahi the same of
// row g+8: a0 = alo.x, a1 = ahi.x, a2 = alo.y, a3 = ahi.y; b = (b0, b1).
#if ROUND == 1
#define MMA_PTX "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#else
#define MMA_PTX "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
#endif
#define MMA(d, alo, ahi, b)                                                                     \
    asm volatile(MMA_PTX " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"            \
                 : "=f"((d)[0]), "=f"((d)[1]), "=f"((d)[2]), "=f"((d)[3])                        \
                 : "r"((alo).x), "r"((ahi).x), "r"((alo).y), "r"((ahi).y), "r"((b).x), "r"((b).y), \
                   "f"((d)[0]), "f"((d)[1]), "f"((d)[2]), "f"((d)[3]))
#endif

#if MMA_EMULATE
// MMA_EMULATE=1 (tests on any OpenCL device, e.g. PoCL): the same kernel with each mma.sync replaced by
// a work-group exchange that gathers the fragments back into matrices by the PTX ISA's layout and sums
// the products in k order, as matmul.cl does; so it checks the staging, swizzle, fragment and output
// mapping above against the portable kernel bit for bit. Slow (two barriers a product).
inline float frag_a(__local const uint* fa, const int r, const int k)  // A (16 x k) of this warp's exchange
{
#if ROUND == 1
    const uint w = fa[(((r & 7) * 4 + ((k & 7) >> 1)) * 4) + (r >> 3) + 2 * (k >> 3)];
    return as_float(((k & 1) ? (w >> 16) : (w & 0xFFFFu)) << 16);
#else
    return as_float(fa[(((r & 7) * 4 + (k & 3)) * 4) + (r >> 3) + 2 * (k >> 2)]);
#endif
}
inline float frag_b(__local const uint* fb, const int k, const int n)  // B (k x 8)
{
#if ROUND == 1
    const uint w = fb[((n * 4 + ((k & 7) >> 1)) * 2) + (k >> 3)];
    return as_float(((k & 1) ? (w >> 16) : (w & 0xFFFFu)) << 16);
#else
    return as_float(fb[((n * 4 + (k & 3)) * 2) + (k >> 2)]);
#endif
}
inline void mma_emulate(float* d, const uint2 alo, const uint2 ahi, const uint2 b, __local uint* xa, __local uint* xb,
                        const int warp, const int lane)
{
    __local uint* fa = xa + warp * 128;
    __local uint* fb = xb + warp * 64;
    fa[lane * 4] = alo.x; fa[lane * 4 + 1] = ahi.x; fa[lane * 4 + 2] = alo.y; fa[lane * 4 + 3] = ahi.y;
    fb[lane * 2] = b.x; fb[lane * 2 + 1] = b.y;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int g = lane >> 2, t = lane & 3;
    for (int c = 0; c < 4; c++) {
        const int r = g + 8 * (c >> 1), n = 2 * t + (c & 1);
        float s = d[c];
        for (int k = 0; k < 8 * KPW; k++) s += frag_a(fa, r, k) * frag_b(fb, k, n);
        d[c] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#define MMA(d, alo, ahi, b) mma_emulate(d, alo, ahi, b, xa, xb, warp, lane)
#endif

#if defined(GROUP)
#define EXTRA_ARGS , const int kc, const int GS, const int bstride, const int cstride, \
    __global const int* counts, __global const int* offs
#elif SPLITK || BATCH
#define EXTRA_ARGS , const int kc, const int HB, const int oA, const int sAb, const int sAh, const int oB, \
    const int sBb, const int sBh, const int oC, const int sCb, const int sCh
#else
#define EXTRA_ARGS
#endif

__kernel __attribute__((reqd_work_group_size(NTH, 1, 1)))
void matmul_mma(const int M, const int N, const int K,
                __global const float* restrict A, const int lda,
                __global const float* restrict B, const int ldb,
                __global float* Cm, const int ldc,
                __global const float* restrict bias,
                __global const float* R,
                const float alpha, __global float* E EXTRA_ARGS)
{
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = get_group_id(0) * BN, m0 = get_group_id(1) * BM;
#include "gemm_offsets.cl"
#if CAUSAL == 1
    if (n0 > m0 + BM - 1) return;
#elif CAUSAL == 2
    kend = min(kend, m0 + BM);
#elif CAUSAL == 3
    kbeg = max(kbeg, m0 / BK * BK);
#endif
    __local uint As[2][BM * KW] __attribute__((aligned(16)));
    __local uint Bs[2][BN * KW] __attribute__((aligned(16)));
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;
    float ra[NRA], rb[NRB];
#if MMA_EMULATE
    __local uint xa[WM * WN * 128], xb[WM * WN * 64];
#endif

    if (kbeg < kend) {
        LOAD_TILE(A, lda, KC_A, BM, m0, mend, kbeg, ra)
        LOAD_TILE(B, ldb, KC_B, BN, n0, N, kbeg, rb)
        STORE_TILE(As[0], KC_A, BM, ra)
        STORE_TILE(Bs[0], KC_B, BN, rb)
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // this work-item's fragment rows: warp (wm, wn) owns rows wm*(BM/WM).. and columns wn*(BN/WN)..
    const int wm = warp / WN, wn = warp % WN;
    const int arow = wm * (BM / WM) + g, brow = wn * (BN / WN) + g;
    const int swz = ((g >> 1) & 1) << 2;  // the row's pair swizzle (rows a multiple of 8 apart share it)
    int cur = 0;
    for (int k0 = kbeg; k0 < kend; k0 += BK) {
        const int nk = k0 + BK;
        if (nk < kend) {
            LOAD_TILE(A, lda, KC_A, BM, m0, mend, nk, ra)
            LOAD_TILE(B, ldb, KC_B, BN, n0, N, nk, rb)
        }
        __local const uint* as = As[cur];
        __local const uint* bs = Bs[cur];
#pragma unroll
        for (int kk = 0; kk < KW / 8; kk++) {  // one mma k-step: 8 words (16 bf16 or 8 tf32)
            const int pair = ((kk * 4 + t) ^ swz) * 2;
            uint2 alo[MT], ahi[MT], b[NT];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                alo[i] = *(__local const uint2*)&as[(arow + 16 * i) * KW + pair];
                ahi[i] = *(__local const uint2*)&as[(arow + 16 * i + 8) * KW + pair];
            }
#pragma unroll
            for (int j = 0; j < NT; j++) b[j] = *(__local const uint2*)&bs[(brow + 8 * j) * KW + pair];
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) MMA(acc[i][j], alo[i], ahi[i], b[j]);
        }
        if (nk < kend) {
            STORE_TILE(As[cur ^ 1], KC_A, BM, ra)
            STORE_TILE(Bs[cur ^ 1], KC_B, BN, rb)
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        cur ^= 1;
    }

#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int gn0 = n0 + wn * (BN / WN) + 8 * j + 2 * t;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int gm = m0 + arow + 16 * i + (c >> 1) * 8, gn = gn0 + (c & 1);
                if (gm >= mend || gn >= N) continue;
#if SPLITK
                Cm[(size_t)gm * ldc + gn] = acc[i][j][c];
#else
                Cm[(size_t)gm * ldc + gn] = epilogue(acc[i][j][c], gm, gn, ldc, Cm, bias, R, E, alpha);
#endif
            }
        }
    }
}

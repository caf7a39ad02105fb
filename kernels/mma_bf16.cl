// mma.sync.m16n8k16 with bf16 operands and fp32 accumulators, shared (#include "mma_bf16.cl") by the
// tensor-core kernels matmul_bf16.cl and flash.cl:
//   MMA16816(d, a, b0, b1): d (float[4]) += A (16x16, a: uint[4]) @ B (16x8, b0 b1), fragments as PTX lays
//   them out (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4): a0 (g, 2t..2t+1), a1 (g+8, 2t..),
//   a2 (g, 2t+8..), a3 (g+8, 2t+8..); b0 (k 2t.., n g), b1 (k 2t+8.., n g); d (g, 2t..2t+1), (g+8, 2t..);
//   two bf16 a word, the lower k (or column) in the low half.
// With MMA_EMULATE (PoCL tests) the warp's lanes exchange their fragments through xw (224 words a warp, the
// caller's `xw` and `lane`) and sum each product in k order, so sums are bit-exact and deterministic.
#ifndef CLGPT_MMA_BF16_CL
#define CLGPT_MMA_BF16_CL
#ifndef MMA_EMULATE
#define MMA_EMULATE 0
#endif
#if !MMA_EMULATE
#define MMA16816(d, a, b0, b1)                                                                         \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
        "{%10,%11,%12,%13};"                                                                           \
        : "=f"((d)[0]), "=f"((d)[1]), "=f"((d)[2]), "=f"((d)[3])                                       \
        : "r"((a)[0]), "r"((a)[1]), "r"((a)[2]), "r"((a)[3]), "r"(b0), "r"(b1), "f"((d)[0]),          \
          "f"((d)[1]), "f"((d)[2]), "f"((d)[3]))
#else
inline float bf16_half(const uint w, const int hi) { return as_float((hi ? (w >> 16) : (w & 0xFFFFu)) << 16); }
inline void mma_emulate(float* d, const uint* a, const uint b0, const uint b1, __local uint* xw, const int lane)
{
    __local uint* xa = xw + 32;   // 4 words a lane
    __local uint* xb = xw + 160;  // 2 words a lane
    for (int q = 0; q < 4; q++) xa[4 * lane + q] = a[q];
    xb[2 * lane] = b0; xb[2 * lane + 1] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int g = lane >> 2, t = lane & 3;
    for (int c = 0; c < 4; c++) {
        const int r = g + 8 * (c >> 1), n = 2 * t + (c & 1);
        float s = d[c];
        for (int k = 0; k < 16; k++) {
            const float av = bf16_half(xa[4 * ((r & 7) * 4 + ((k & 7) >> 1)) + (r >> 3) + 2 * (k >> 3)], k & 1);
            const float bv = bf16_half(xb[2 * (n * 4 + ((k & 7) >> 1)) + (k >> 3)], k & 1);
            s += av * bv;
        }
        d[c] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#define MMA16816(d, a, b0, b1) mma_emulate(d, a, b0, b1, xw, lane)
#endif
#endif

// Operand rounding of the reduced-precision matmuls, shared (#include "precision.cl") by the portable
// kernels (matmul.cl, -D ROUND) and the tensor-core ones (matmul_mma.cl), so both round bit for bit alike:
//   ROUND 0: fp32 (operands as they are)
//   ROUND 1: bf16, round to nearest even to 8 mantissa bits (what a bf16 copy of the operand holds)
//   ROUND 2: tf32, round to nearest, ties away from zero, to 10 mantissa bits (PTX cvt.rna.tf32.f32)
// Products of two rounded operands are exact in fp32 (8x8 or 11x11 significant bits); sums stay fp32.
// NaN and infinity pass through unchanged.
#ifndef CLGPT_PRECISION_CL
#define CLGPT_PRECISION_CL
#ifndef ROUND
#define ROUND 0
#endif

// x rounded to bf16, as the 16-bit pattern (the top half of the float's bits)
inline uint bf16_bits(const float x)
{
    const uint u = as_uint(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return u >> 16;  // inf, NaN: truncated (NaN payloads stay nonzero
                                                           // in our data: they come from 0x7FC00000)
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

inline float round_bf16(const float x) { return as_float(bf16_bits(x) << 16); }

// two floats as two bf16 in one word, lo in the low half. BF16_CVT 1 (NVIDIA builds: clgpt.device.capabilities
// bf16_options): the hardware's conversion, cvt.rn.bf16x2.f32 (sm_80 and later), one instruction for the pair
// where the integer form takes about eight a value (flash attention rounds every probability and its gradient
// so); the same round to nearest even, so the same bits for every float but NaN, which comes out as 0x7FFF
// instead of its truncated payload (bench/bf16_cvt_check.py compares the two over all 2^32 patterns).
#ifndef BF16_CVT
#define BF16_CVT 0
#endif
#if BF16_CVT
inline uint bf16x2(const float lo, const float hi)
{
    uint r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
inline uint bf16x2(const float lo, const float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }
#endif

// eight floats as eight bf16 in 16 bytes, v[0] lowest
inline uint4 bf16x8(const float* v)
{
    return (uint4)(bf16x2(v[0], v[1]), bf16x2(v[2], v[3]), bf16x2(v[4], v[5]), bf16x2(v[6], v[7]));
}

// The bf16 copies kernels/matmul_wgmma.cl reads (matmul_bf16.cl to_bf16 with TILED 1, xent.cl
// xent_backward_tiled): an Rp x Cp matrix (multiples of 64 and 8) as Cp/64 x Rp/8 atoms of 8 rows x 64 columns
// (1 KB, the atoms of one 64-column block back to back), row r of an atom 128 bytes, its 16-byte chunk c
// (columns 8c..8c+7) stored at chunk c ^ r (wgmma's 128-byte swizzle). Index of the chunk holding (r, k):
inline size_t tiled_chunk(const int r, const int k, const int Rp)
{
    return (((size_t)(k >> 6) * (Rp >> 3) + (r >> 3)) * 8 + (r & 7)) * 8 + (((k >> 3) & 7) ^ (r & 7));
}

// Producers writing their output's tiled copy as they go: columns k, k + 1 (k even) or k..k + 3 (k a multiple
// of 4) of row r, as bf16, into the copy O (Rp rows)
inline void tiled_store2(__global uint* O, const int r, const int k, const int Rp, const float2 v)
{
    O[4 * tiled_chunk(r, k, Rp) + ((k & 7) >> 1)] = bf16x2(v.x, v.y);
}
inline void tiled_store4(__global uint2* O, const int r, const int k, const int Rp, const float4 v)
{
    O[2 * tiled_chunk(r, k, Rp) + ((k >> 2) & 1)] = (uint2)(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
}

inline float round_tf32(const float x)
{
    const uint u = as_uint(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return x;
    return as_float((u + 0x1000u) & 0xFFFFE000u);
}

// Vector forms for matmul_rb (W = 8 or 16 floats a vector), the same bits as the scalar ones lane by lane
#define CLGPT_ROUND_VEC(W)                                                                        \
    inline float##W round##W##_bf16(const float##W x)                                             \
    {                                                                                             \
        const uint##W u = as_uint##W(x);                                                          \
        const uint##W r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;                          \
        return as_float##W(select(r, u & 0xFFFF0000u, (u & 0x7F800000u) == 0x7F800000u));         \
    }                                                                                             \
    inline float##W round##W##_tf32(const float##W x)                                             \
    {                                                                                             \
        const uint##W u = as_uint##W(x);                                                          \
        return as_float##W(select((u + 0x1000u) & 0xFFFFE000u, u, (u & 0x7F800000u) == 0x7F800000u)); \
    }
CLGPT_ROUND_VEC(8)
CLGPT_ROUND_VEC(16)

#if ROUND == 1
#define ROUND_OP(x) round_bf16(x)
#define ROUND_OP8(x) round8_bf16(x)
#define ROUND_OP16(x) round16_bf16(x)
#elif ROUND == 2
#define ROUND_OP(x) round_tf32(x)
#define ROUND_OP8(x) round8_tf32(x)
#define ROUND_OP16(x) round16_tf32(x)
#else
#define ROUND_OP(x) (x)
#define ROUND_OP8(x) (x)
#define ROUND_OP16(x) (x)
#endif
#endif

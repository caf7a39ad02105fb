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

inline float round_tf32(const float x)
{
    const uint u = as_uint(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return x;
    return as_float((u + 0x1000u) & 0xFFFFE000u);
}

// float8 forms (matmul_rb), same bits as the scalar ones lane by lane
inline float8 round8_bf16(const float8 x)
{
    const uint8 u = as_uint8(x);
    const uint8 r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return as_float8(select(r, u & 0xFFFF0000u, (u & 0x7F800000u) == 0x7F800000u));
}

inline float8 round8_tf32(const float8 x)
{
    const uint8 u = as_uint8(x);
    return as_float8(select((u + 0x1000u) & 0xFFFFE000u, u, (u & 0x7F800000u) == 0x7F800000u));
}

// float16 forms (matmul_rb with VW 16), the same lane by lane
inline float16 round16_bf16(const float16 x)
{
    const uint16 u = as_uint16(x);
    const uint16 r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return as_float16(select(r, u & 0xFFFF0000u, (u & 0x7F800000u) == 0x7F800000u));
}

inline float16 round16_tf32(const float16 x)
{
    const uint16 u = as_uint16(x);
    return as_float16(select((u + 0x1000u) & 0xFFFFE000u, u, (u & 0x7F800000u) == 0x7F800000u));
}

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

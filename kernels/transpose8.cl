// CPU helpers shared by the CPU forms of layernorm.cl and rmsnorm.cl (#include "transpose8.cl"): float8 and
// float16 access at 4-byte alignment (plain vector loads, inlined), and tr8_rows, 8 rows of 8 floats turned in
// registers (unpack, shuffle, 128-bit lane swaps), after which 8 rows' in-order sums run as one float8.
#ifndef CLGPT_TRANSPOSE8_CL
#define CLGPT_TRANSPOSE8_CL
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
typedef float float16u __attribute__((ext_vector_type(16), aligned(4)));
#define VLD8(p) (*(__global const float8u*)(p))
#define VST8(p, v) (*(__global float8u*)(p) = (v))
#define VLD16(p) (*(__global const float16u*)(p))
#define VST16(p, v) (*(__global float16u*)(p) = (v))
#define SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
// r[0..7] (8 rows of 8 floats) -> its transpose in place: r[j] = column j, lane i = row i
inline void tr8_rows(float8* r)
{
    const float8 t0 = SHUF(r[0], r[1], 0, 8, 1, 9, 4, 12, 5, 13), t1 = SHUF(r[0], r[1], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t2 = SHUF(r[2], r[3], 0, 8, 1, 9, 4, 12, 5, 13), t3 = SHUF(r[2], r[3], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t4 = SHUF(r[4], r[5], 0, 8, 1, 9, 4, 12, 5, 13), t5 = SHUF(r[4], r[5], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t6 = SHUF(r[6], r[7], 0, 8, 1, 9, 4, 12, 5, 13), t7 = SHUF(r[6], r[7], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 s0 = SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), s1 = SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s2 = SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), s3 = SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s4 = SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), s5 = SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s6 = SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), s7 = SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    r[0] = SHUF(s0, s4, 0, 1, 2, 3, 8, 9, 10, 11);
    r[1] = SHUF(s1, s5, 0, 1, 2, 3, 8, 9, 10, 11);
    r[2] = SHUF(s2, s6, 0, 1, 2, 3, 8, 9, 10, 11);
    r[3] = SHUF(s3, s7, 0, 1, 2, 3, 8, 9, 10, 11);
    r[4] = SHUF(s0, s4, 4, 5, 6, 7, 12, 13, 14, 15);
    r[5] = SHUF(s1, s5, 4, 5, 6, 7, 12, 13, 14, 15);
    r[6] = SHUF(s2, s6, 4, 5, 6, 7, 12, 13, 14, 15);
    r[7] = SHUF(s3, s7, 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

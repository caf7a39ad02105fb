// One RoPE pair rotated: (a, b) = (x[2i], x[2i+1]) of a head by the angle whose cosine and sine are c, s
//   -> (a c - b s, a s + b c)          (the transposed rotation: s -> -s)
// Shared (#include "rope_pair.cl") by rope.cl's per-pair kernels and flash.cl's fused ones (flash_bf16_rope,
// the dq and dk stores with ROPE): one expression in one place, so whatever the compiler contracts (FP_CONTRACT
// is on by default in OpenCL C: a c - b s may become fma(a, c, -(b s))) it contracts alike in both, and the
// fused path rotates to the bits the separate launches give.
#ifndef CLGPT_ROPE_PAIR_CL
#define CLGPT_ROPE_PAIR_CL
inline float2 rope_pair(const float a, const float b, const float c, const float s)
{
    return (float2)(a * c - b * s, a * s + b * c);
}
#endif

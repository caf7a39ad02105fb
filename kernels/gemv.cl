// Matrix-vector products of a decode step: a few rows x (B, K) against a weight W (N, K) stored as the GGUF has
// it (out, in), so each output reads one contiguous row of W and no transposed copy is made per call.
// -D: K, BIAS (add bias (N)), RESID (add resid (B, N)), GELU (also write E (B, N) = gelu(y), tanh form as
//     kernels/gelu.cl; y keeps the pre-activation)
//   y[b, n] = sum_k x[b, k] W[n, k] (+ bias[n]) (+ resid[b, n])
// One work-item a (n, b): eight k at a time as float8 partial sums, then their sum, then the tail k.
#ifndef K
#error "K must be defined"
#endif
#define GELU_S 0.7978845608028654f

__kernel void gemv_nt(const int B, const int N, __global const float* x, __global const float* W,
                      __global const float* bias, __global const float* resid, __global float* y,
                      __global float* E)
{
    const int n = get_global_id(0), b = get_global_id(1);
    if (n >= N || b >= B) return;
    __global const float* xr = x + (long)b * K;
    __global const float* w = W + (long)n * K;
    float8 acc = 0.0f;
    int k = 0;
    for (; k + 8 <= K; k += 8) acc += vload8(0, xr + k) * vload8(0, w + k);
    const float4 h4 = acc.lo + acc.hi;
    const float2 h2 = h4.lo + h4.hi;
    float s = h2.x + h2.y;
    for (; k < K; k++) s += xr[k] * w[k];
#if BIAS
    s += bias[n];
#endif
#if RESID
    s += resid[(long)b * N + n];
#endif
    y[(long)b * N + n] = s;
#if GELU
    const float u = GELU_S * (s + 0.044715f * s * s * s);
    E[(long)b * N + n] = s - s / (exp(2.0f * u) + 1.0f);
#endif
}

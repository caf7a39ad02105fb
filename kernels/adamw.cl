// Global gradient norm, clipping and AdamW over one flat buffer of all parameters (n floats).
//   grad_norm_partial: partials[i] = sum_{j in chunk i} g[j]^2          (chunk = ceil(n / n_parts))
//                      -DSTRIDED=1 (GPUs): partials[i] = sum_{j = i mod n_parts} g[j]^2, coalesced reads
//   grad_norm_final:   out[0] = sqrt(sum_i partials[i]);  out[1] = clip > 0 ? min(1, clip / out[0]) : 1
//   adamw:             g = grad * out[1];  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//                      p -= lr wd p (only j < n_decay);  p -= lr (m / bc1) / (sqrt(v / bc2) + eps)
#ifndef STRIDED
#define STRIDED 0
#endif
// Two stages with fixed orders: deterministic. Parameters that decay come first in the flat buffer.

__kernel void grad_norm_partial(const int n, const int chunk, __global const float* g, __global float* partials)
{
    const int i = get_global_id(0);
    float s = 0.0f;
#if STRIDED
    const int n_parts = get_global_size(0);
    for (int j = i; j < n; j += n_parts) s += g[j] * g[j];
#else
    const int lo = i * chunk;
    const int hi = min(n, lo + chunk);
    for (int j = lo; j < hi; j++) s += g[j] * g[j];
#endif
    partials[i] = s;
}

__kernel void grad_norm_final(const int n_parts, const float clip, __global const float* partials,
                              __global float* out)
{
    if (get_global_id(0) != 0) return;
    float s = 0.0f;
    for (int i = 0; i < n_parts; i++) s += partials[i];
    const float norm = sqrt(s);
    out[0] = norm;
    out[1] = (clip > 0.0f && norm > clip) ? clip / norm : 1.0f;
}

// One parameter j: clip-scale its gradient by s (written back), update m, v, then p (decoupled decay).
inline void adamw_one(const int j, const int n_decay, __global float* p, __global float* grad,
                      __global float* m, __global float* v, const float s, const float lr, const float beta1,
                      const float beta2, const float bc1, const float bc2, const float eps, const float weight_decay)
{
    float g = grad[j];
    if (s != 1.0f) { g *= s; grad[j] = g; }
    const float mj = beta1 * m[j] + (1.0f - beta1) * g;
    const float vj = beta2 * v[j] + (1.0f - beta2) * g * g;
    m[j] = mj;
    v[j] = vj;
    float pj = p[j];
    if (j < n_decay) pj -= lr * weight_decay * pj;
    p[j] = pj - lr * (mj / bc1) / (sqrt(vj / bc2) + eps);
}

__kernel void adamw(const int n, const int n_decay, __global float* p, __global float* grad,
                    __global float* m, __global float* v, __global const float* norm,
                    const float lr, const float beta1, const float beta2, const float bc1, const float bc2,
                    const float eps, const float weight_decay)
{
    const int j = get_global_id(0);
    if (j < n) adamw_one(j, n_decay, p, grad, m, v, norm[1], lr, beta1, beta2, bc1, bc2, eps, weight_decay);
}

// CPUs: adamw with 8 parameters a work-item as float8 (PoCL left the scalar kernel's sqrt and division
// unvectorised: ~5 ns a parameter); the same per-element arithmetic in the same order. Global size ceil(n / 8).
typedef float float8a __attribute__((ext_vector_type(8), aligned(4)));
#define VLD8(p) (*(__global const float8a*)(p))
#define VST8(p, x) (*(__global float8a*)(p) = (x))
__kernel void adamw_v8(const int n, const int n_decay, __global float* p, __global float* grad,
                       __global float* m, __global float* v, __global const float* norm,
                       const float lr, const float beta1, const float beta2, const float bc1, const float bc2,
                       const float eps, const float weight_decay)
{
    const int j0 = get_global_id(0) * 8;
    if (j0 >= n) return;
    const float s = norm[1];
    if (j0 + 8 <= n) {
        float8 g = VLD8(grad + j0);
        if (s != 1.0f) { g *= s; VST8(grad + j0, g); }
        const float8 mj = beta1 * VLD8(m + j0) + (1.0f - beta1) * g;
        const float8 vj = beta2 * VLD8(v + j0) + (1.0f - beta2) * g * g;
        VST8(m + j0, mj);
        VST8(v + j0, vj);
        float8 pj = VLD8(p + j0);
        const int8 dec = (int8)(j0) + (int8)(0, 1, 2, 3, 4, 5, 6, 7) < (int8)(n_decay);
        pj = select(pj, pj - lr * weight_decay * pj, dec);
        VST8(p + j0, pj - lr * (mj / bc1) / (sqrt(vj / bc2) + eps));
    } else {
        for (int j = j0; j < n; j++)
            adamw_one(j, n_decay, p, grad, m, v, s, lr, beta1, beta2, bc1, bc2, eps, weight_decay);
    }
}

// GPUs: the norm's partial sums as work-groups of LW work-items (kernels/reduce.cl's fixed-order tree):
// grad_norm_partial_wg: partials[i] = the sum over work-group i of its work-items' strided sums of g[j]^2
// (j = its global id + multiples of the global size), so every work-item keeps loads in flight;
// grad_norm_final_wg (one work-group): out as grad_norm_final, the partials summed strided, then the tree.
#ifdef LW
#include "reduce.cl"
__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void grad_norm_partial_wg(const int n, __global const float* g, __global float* partials)
{
    __local float red[LW];
    float s = 0.0f;
    for (size_t j = get_global_id(0); j < (size_t)n; j += get_global_size(0)) s += g[j] * g[j];
    s = wg_sum(red, s);
    if (get_local_id(0) == 0) partials[get_group_id(0)] = s;
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void grad_norm_final_wg(const int n_parts, const float clip, __global const float* partials, __global float* out)
{
    __local float red[LW];
    float s = 0.0f;
    for (int i = get_local_id(0); i < n_parts; i += LW) s += partials[i];
    s = wg_sum(red, s);
    if (get_local_id(0) == 0) {
        const float norm = sqrt(s);
        out[0] = norm;
        out[1] = (clip > 0.0f && norm > clip) ? clip / norm : 1.0f;
    }
}
#endif

// CPUs (PoCL): grad_norm_partial (chunks, not STRIDED; same launch and arguments): partials[i] = sum of g[j]^2
// over chunk i, as four float8 chains (32 floats a step), the 32 lanes summed in a fixed order at the end,
// then the scalar tail. Deterministic; another order of summation than grad_norm_partial's.
__kernel void grad_norm_partial_v8(const int n, const int chunk, __global const float* g, __global float* partials)
{
    const int i = get_global_id(0);
    const int lo = i * chunk, hi = min(n, lo + chunk);
    float8 s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int j = lo;
    for (; j + 32 <= hi; j += 32) {
        const float8 a = VLD8(g + j), b = VLD8(g + j + 8), c = VLD8(g + j + 16), d = VLD8(g + j + 24);
        s0 += a * a; s1 += b * b; s2 += c * c; s3 += d * d;
    }
    const float8 sv = (s0 + s1) + (s2 + s3);
    const float4 h4 = sv.lo + sv.hi;
    const float2 h2 = h4.lo + h4.hi;
    float s = h2.x + h2.y;
    for (; j < hi; j++) s += g[j] * g[j];
    partials[i] = s;
}

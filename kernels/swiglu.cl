// SwiGLU gate, elementwise over n values: the feed-forward is ffn_down(silu(ffn_gate x) * ffn_up x).
//   forward:  y = silu(g) * u,  silu(g) = g * sigmoid(g)
//   backward: du = dy * silu(g);  dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
// sigmoid is 1 / (1 + exp(-g)): exp -> inf gives 0, exp -> 0 gives 1, no NaN at either end.

__kernel void swiglu_forward(const int n, __global const float* gate, __global const float* up,
                             __global float* y)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float g = gate[i];
    y[i] = g / (1.0f + exp(-g)) * up[i];
}

__kernel void swiglu_backward(const int n, __global const float* dy, __global const float* gate,
                              __global const float* up, __global float* dgate, __global float* dup)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float g = gate[i], d = dy[i];
    const float sg = 1.0f / (1.0f + exp(-g));
    dup[i] = d * g * sg;
    dgate[i] = d * up[i] * sg * (1.0f + g * (1.0f - sg));
}

// On wgmma, the experts' form (clgpt/ops/grouped.py moe_tiled; -D EXPERTS_TILED): h (R, 2W) from their one
// gate | up product, each row gate | up as the dense form's; y only as the bf16 tiled copy the down product reads
// (precision.cl tiled_store4; R rows a multiple of 64, W columns of 4), the same formula lane by lane. 2-D launch
// (W/4, R): four columns of a row an item. The backward is the down product's epilogue (EPI 3).
#ifdef EXPERTS_TILED
#include "precision.cl"
__kernel void swiglu_rows_forward_tiled(const int R, const int W, __global const float* h, __global uint2* y16)
{
    const int f = 4 * get_global_id(0), r = get_global_id(1);
    if (f >= W || r >= R) return;
    const size_t o = (size_t)r * 2 * W + f;
    const float4 g = vload4(0, h + o);
    tiled_store4(y16, r, f, R, g / (1.0f + exp(-g)) * vload4(0, h + o + W));
}
#endif

// The dense feed-forward's form: gate and up come from one product, h (N, 2F) = gate | up per row.
// One work-item per row (launch (N), local size 1: CPUs), F values in float8 blocks then a scalar tail;
// the same formula as above, element by element.  -D F
//   forward:  y (N,F) = silu(h[:, :F]) * h[:, F:]
// (its backward, dh (N,2F) = dgate | dup, is the epilogue EPI 3 of the dact product, kernels/matmul.cl)
#ifdef F
#ifndef SW  // floats a vector: 16 on CPUs with AVX-512 (clgpt/ops/layers.py), else 8; the same formula lane by lane
#define SW 8
#endif
typedef float floatsw __attribute__((ext_vector_type(SW)));
typedef float floatswu __attribute__((ext_vector_type(SW), aligned(4)));
#define VLD(p) (*(__global const floatswu*)(p))
#define VST(p, v) (*(__global floatswu*)(p) = (v))

__kernel void swiglu_rows_forward(const int N, __global const float* h, __global float* y)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* g = h + (size_t)n * 2 * F;
    __global const float* u = g + F;
    __global float* o = y + (size_t)n * F;
    int f = 0;
    for (; f + SW <= F; f += SW) {
        const floatsw gv = VLD(g + f);
        VST(o + f, gv / (1.0f + exp(-gv)) * VLD(u + f));
    }
    for (; f < F; f++) o[f] = g[f] / (1.0f + exp(-g[f])) * u[f];
}

// GPUs: one work-item per output, 2-D launch (F, N) (a row's F values in one work-item left most of a GPU idle).
__kernel void swiglu_rows_forward_el(const int N, __global const float* h, __global float* y)
{
    const int f = get_global_id(0), n = get_global_id(1);
    if (f >= F || n >= N) return;
    const float g = h[(size_t)n * 2 * F + f];
    y[(size_t)n * F + f] = g / (1.0f + exp(-g)) * h[(size_t)n * 2 * F + F + f];
}

// GPUs, F % 4 == 0: 4 consecutive outputs a work-item as float4s (16-byte loads and stores, a quarter of the
// work-items and their index arithmetic), the same formula lane by lane. 2-D launch
// (ceil(F/4 / 64) * 64, ceil(N / 4) * 4), local (64, 4); work-item (q, n) writes y[n, 4q..4q+3].
// SWIGLU_TILED 1 (N, F multiples of 64): also y's bf16 copy in matmul_wgmma.cl's tiled layout (precision.cl
// tiled_chunk, Rp = N), the copy the down product reads (as layernorm.cl's LN_TILED: no second pass over y);
// SWIGLU_TILED 2: that copy alone, where the products are y's only readers (y itself is not written).
#if F % 4 == 0
#ifndef SWIGLU_TILED
#define SWIGLU_TILED 0
#endif
#if SWIGLU_TILED
#include "precision.cl"
#define SWIGLU_TILED_ARGS , __global uint2* y16
#else
#define SWIGLU_TILED_ARGS
#endif
__kernel void swiglu_rows_forward_v4(const int N, __global const float* h, __global float* y SWIGLU_TILED_ARGS)
{
    const int q = get_global_id(0), n = get_global_id(1);
    if (q >= F / 4 || n >= N) return;
    __global const float4* g4 = (__global const float4*)(h + (size_t)n * 2 * F) + q;
    const float4 g = g4[0], u = g4[F / 4];
    const float4 v = g / (1.0f + exp(-g)) * u;
#if SWIGLU_TILED != 2
    ((__global float4*)(y + (size_t)n * F))[q] = v;
#endif
#if SWIGLU_TILED
    tiled_store4(y16, n, 4 * q, N, v);
#endif
}
#endif

#endif

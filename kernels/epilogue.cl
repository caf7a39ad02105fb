// The matmul epilogue, shared (#include "epilogue.cl") by matmul.cl, matmul_mma.cl, matmul_bf16.cl and
// matmul_wgmma.cl: one output
// c = alpha * acc [+ bias] [+ R] [+ C], then EPI (1: also E = gelu(c); 2: c *= gelu'(E); 3: SwiGLU backward,
// with ldc = 2N: E's row is gate | up, c is dact, C's row gets dgate (returned, columns 0..N-1) and dup (written
// at column N + gn)).
// -D BIAS, RESID, ACCUM, EPI and SPLITK (store_pair) select the operations; each defaults to 0 here.
#ifndef CLGPT_EPILOGUE_CL
#define CLGPT_EPILOGUE_CL
#ifndef BIAS
#define BIAS 0
#endif
#ifndef RESID
#define RESID 0
#endif
#ifndef ACCUM
#define ACCUM 0
#endif
#ifndef EPI
#define EPI 0
#endif
#ifndef SPLITK
#define SPLITK 0
#endif
#define GELU_S 0.7978845608028654f

// The output tile a work-group takes, as (n tile, m tile), with -D TILE_BAND (rows of tiles a band; 0: as
// launched). Work-groups start in launch order, dimension 0 fastest: taken as launched, the tiles running at once
// span a row or two of m and all of n, so each reads its own columns of B, and a B larger than the cache (the
// head's vocabulary x C weights) comes from memory once a row of tiles. In bands of TILE_BAND rows, down a band
// before along n, the tiles running at once share their B columns and the band's rows of A in the cache.
#ifndef TILE_BAND
#define TILE_BAND 0
#endif
inline int2 tile_of_group(void)
{
#if TILE_BAND
    const int gn = get_num_groups(0), gm = get_num_groups(1), pid = get_group_id(1) * gn + get_group_id(0);
    const int band = pid / (TILE_BAND * gn), first = band * TILE_BAND, rows = min(gm - first, TILE_BAND);
    const int in = pid - band * TILE_BAND * gn;
    return (int2)(in / rows, first + in % rows);
#else
    return (int2)(get_group_id(0), get_group_id(1));
#endif
}

// gelu(x) and gelu'(x), tanh form, tanh u = 1 - 2 / (exp(2u) + 1) as in gelu.cl
inline float gelu_f(const float x)
{
    return x - x / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
}
inline float gelu_df(const float x)
{
    const float t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (x + 0.044715f * x * x * x)) + 1.0f);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
}

// The epilogue of one output: c = alpha * acc [+ bias] [+ R] [+ C], then EPI.
inline float epilogue(const float acc, const int gm, const int gn, const int ldc, __global float* Cm,
                      __global const float* bias, __global const float* R, __global float* E, const float alpha)
{
    float c = alpha * acc;
#if BIAS
    c += bias[gn];
#endif
#if RESID
    c += R[gm * ldc + gn];
#endif
#if ACCUM
    c += Cm[gm * ldc + gn];
#endif
#if EPI == 1
    E[gm * ldc + gn] = gelu_f(c);
#elif EPI == 2
    c *= gelu_df(E[gm * ldc + gn]);
#elif EPI == 3  // as kernels/swiglu.cl's backward, element by element; N = ldc / 2
    const float g = E[gm * ldc + gn], u = E[gm * ldc + ldc / 2 + gn];
    const float sg = 1.0f / (1.0f + exp(-g));
    Cm[gm * ldc + ldc / 2 + gn] = c * g * sg;
    c = c * u * sg * (1.0f + g * (1.0f - sg));
#endif
    return c;
}

// The epilogue of two adjacent outputs (gn even, ldc even: 8-byte aligned pairs), the same
// operations in the same order per output
inline float2 epilogue2(const float2 acc, const int gm, const int gn, const int ldc, __global float* Cm,
                        __global const float* bias, __global const float* R, __global float* E, const float alpha)
{
    const size_t o = (size_t)gm * ldc + gn;
    float2 c = alpha * acc;
#if BIAS
    c += *(__global const float2*)(bias + gn);
#endif
#if RESID
    c += *(__global const float2*)(R + o);
#endif
#if ACCUM
    c += *(__global const float2*)(Cm + o);
#endif
#if EPI == 1
    *(__global float2*)(E + o) = (float2)(gelu_f(c.x), gelu_f(c.y));
#elif EPI == 2
    const float2 e = *(__global const float2*)(E + o);
    c.x *= gelu_df(e.x);
    c.y *= gelu_df(e.y);
#elif EPI == 3  // as epilogue's; up's pair need not be 8-byte aligned (N = ldc / 2 may be odd)
    const float2 g = *(__global const float2*)(E + o), u = vload2(0, E + o + ldc / 2);
    const float2 sg = 1.0f / (1.0f + exp(-g));
    vstore2(c * g * sg, 0, Cm + o + ldc / 2);
    c = c * u * sg * (1.0f + g * (1.0f - sg));
#endif
    return c;
}

// The epilogue of four adjacent outputs whose operands the caller loaded (b: bias, r: R, c0: Cm's old values,
// e: E, where BIAS, RESID, ACCUM, EPI 2 read them): the same operations in the same order per output as
// epilogue; EPI 1's gelu(c) is the caller's to store.
inline float4 epilogue4(const float4 acc, const float4 b, const float4 r, const float4 c0, const float4 e,
                        const float alpha)
{
    float4 c = alpha * acc;
#if BIAS
    c += b;
#endif
#if RESID
    c += r;
#endif
#if ACCUM
    c += c0;
#endif
#if EPI == 2
    c = (float4)(c.x * gelu_df(e.x), c.y * gelu_df(e.y), c.z * gelu_df(e.z), c.w * gelu_df(e.w));
#endif
    return c;
}

// Split-K in the tensor-core kernels (matmul_bf16.cl, matmul_wgmma.cl): with SPLITK the kernel takes the chunk
// depth kc as its last argument (SPLIT_ARGS), and work-group z along dimension 2 sums k in [z kc, min(Kp, (z+1) kc))
// into the z-th M x ldc slice of Cm: SPLIT_RANGE narrows the kernel's kbeg, kend (0, Kp before) and moves Cm
// (the kernel's M, ldc, Cm).
#if SPLITK
#define SPLIT_ARGS , const int kc
#define SPLIT_RANGE(kbeg, kend, Kp)                  \
    {                                                \
        kbeg = get_group_id(2) * kc;                 \
        kend = min(Kp, kbeg + kc);                   \
        Cm += (size_t)get_group_id(2) * M * ldc;     \
    }
#else
#define SPLIT_ARGS
#define SPLIT_RANGE(kbeg, kend, Kp)
#endif

// Two adjacent outputs (gm, gn) and (gm, gn + 1) of a tensor-core tile (matmul_bf16.cl, matmul_wgmma.cl), gm < M
// and gn < N: one float2 through epilogue2 where both lie inside and pairs (ldc even: 8-byte aligned) is set,
// else one by one through epilogue; with SPLITK the raw sums.
inline void store_pair(const float2 v, const int gm, const int gn, const int N, const int ldc, const int pairs,
                       __global float* Cm, __global const float* bias, __global const float* R, __global float* E,
                       const float alpha)
{
    if (pairs && gn + 1 < N) {
        __global float2* p = (__global float2*)(Cm + (size_t)gm * ldc + gn);
#if SPLITK
        *p = v;
#else
        *p = epilogue2(v, gm, gn, ldc, Cm, bias, R, E, alpha);
#endif
    } else {
#if SPLITK
        Cm[(size_t)gm * ldc + gn] = v.x;
        if (gn + 1 < N) Cm[(size_t)gm * ldc + gn + 1] = v.y;
#else
        Cm[(size_t)gm * ldc + gn] = epilogue(v.x, gm, gn, ldc, Cm, bias, R, E, alpha);
        if (gn + 1 < N) Cm[(size_t)gm * ldc + gn + 1] = epilogue(v.y, gm, gn + 1, ldc, Cm, bias, R, E, alpha);
#endif
    }
}
#endif

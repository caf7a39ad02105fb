// The matmul epilogue, shared (#include "epilogue.cl") by matmul.cl and matmul_mma.cl: one output
// c = alpha * acc [+ bias] [+ R] [+ C], then EPI (1: also E = gelu(c); 2: c *= gelu'(E)).
// Needs BIAS, RESID, ACCUM, EPI defined first.
#ifndef CLGPT_EPILOGUE_CL
#define CLGPT_EPILOGUE_CL
#define GELU_S 0.7978845608028654f

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
#endif
    return c;
}
#endif

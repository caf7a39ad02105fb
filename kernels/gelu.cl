// GELU, tanh form, elementwise over n values.
//   forward:  y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   backward: dx = dy * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// tanh u is computed as 1 - 2 / (exp(2u) + 1): on PoCL this is about twice as fast as tanh(), and it
// saturates correctly (exp -> inf gives 1, exp -> 0 gives -1).
#define GELU_S 0.7978845608028654f

__kernel void gelu_forward(const int n, __global const float* x, __global float* y)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    const float u = GELU_S * (v + 0.044715f * v * v * v);
    y[i] = v - v / (exp(2.0f * u) + 1.0f);  // = 0.5 v (1 + tanh u)
}

__kernel void gelu_backward(const int n, __global const float* dy, __global const float* x, __global float* dx)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    const float t = 1.0f - 2.0f / (exp(2.0f * GELU_S * (v + 0.044715f * v * v * v)) + 1.0f);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * 0.044715f * v * v));
}

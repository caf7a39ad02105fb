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

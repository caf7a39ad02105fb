// Muon's elementwise parts (the Newton-Schulz products run on the GEMM: clgpt/ops/muon.py). Flat float buffers;
// `off` is where a matrix starts inside a flat buffer (a tensor's offset, plus e*R*C for expert e).
//   muon_momentum:   g = grad[j] * s (s = norm[1], the global clip factor; grad keeps its value)
//                    buf[j] = lerp(buf[j], g, 1 - mu);  u[j] = nesterov ? lerp(g, buf[j], mu) : buf[j]
//                    (lerp(a, b, w) = a + w (b - a), as torch.optim.Muon writes it), j < n
//   muon_sumsq:      partials[i] = sum_{j in chunk i} x[off + j]^2        (chunk = ceil(n / n_parts))
//   muon_inv_norm:   out[0] = 1 / max(sqrt(sum_i partials[i]), eps)
//   muon_scale:      y[j] = x[off + j] * scale[0]                         (X0 = U / max(||U||_F, eps))
//   muon_poly_init:  P (r, r) = b A + a I          (the GEMM then adds c A A: X' = a X + (b A + c A A) X = P X)
//   muon_update:     p[off + j] = p[off + j] * decay - lr_adj * o[j]       (decay = 1 - lr wd; o: NS's output)
// Fixed orders of summation: deterministic.

__kernel void muon_momentum(const int n, const float mu, const int nesterov, __global const float* grad,
                            __global float* buf, __global float* u, __global const float* norm)
{
    const int j = get_global_id(0);
    if (j >= n) return;
    const float g = grad[j] * norm[1];
    const float b = buf[j] + (1.0f - mu) * (g - buf[j]);
    buf[j] = b;
    u[j] = nesterov ? g + mu * (b - g) : b;
}

__kernel void muon_sumsq(const int n, const int off, const int chunk, __global const float* x,
                         __global float* partials)
{
    const int i = get_global_id(0);
    const int lo = i * chunk, hi = min(n, lo + chunk);
    float s = 0.0f;
    for (int j = lo; j < hi; j++) s += x[off + j] * x[off + j];
    partials[i] = s;
}

__kernel void muon_inv_norm(const int n_parts, const float eps, __global const float* partials, __global float* out)
{
    if (get_global_id(0) != 0) return;
    float s = 0.0f;
    for (int i = 0; i < n_parts; i++) s += partials[i];
    out[0] = 1.0f / fmax(sqrt(s), eps);
}

__kernel void muon_scale(const int n, const int off, __global const float* x, __global const float* scale,
                         __global float* y)
{
    const int j = get_global_id(0);
    if (j < n) y[j] = x[off + j] * scale[0];
}

__kernel void muon_poly_init(const int r, const float a, const float b, __global const float* A, __global float* P)
{
    const int j = get_global_id(0);
    if (j < r * r) P[j] = b * A[j] + (j / r == j % r ? a : 0.0f);
}

__kernel void muon_update(const int n, const int off, __global float* p, __global const float* o,
                          const float decay, const float lr_adj)
{
    const int j = get_global_id(0);
    if (j < n) p[off + j] = p[off + j] * decay - lr_adj * o[j];
}

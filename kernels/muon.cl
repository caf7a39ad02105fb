// Muon's elementwise parts (the Newton-Schulz products run on the batched GEMM: clgpt/ops/muon.py). Flat float
// buffers. The matrices of one shape (R, C), n = R*C floats each, are orthogonalised together: `offs[g]` is where
// matrix g starts in the flat buffer (a tensor's offset, plus e*R*C for expert e); the stack holds them at a
// stride (matrix g at g*ld, ld >= n); g = get_global_id(1) (get_group_id(0) for muon_norms).
//   muon_momentum:   g = grad[j] * s (s = norm[1], the global clip factor; grad keeps its value)
//                    buf[j] = lerp(buf[j], g, 1 - mu);  u[j] = nesterov ? lerp(g, buf[j], mu) : buf[j]
//                    (lerp(a, b, w) = a + w (b - a), as torch.optim.Muon writes it), j < n
//   muon_norms:      scale[g] = 1 / max(||x[offs[g] .. + n)||_F, eps): work-group g, `parts` work-items, item i
//                    the squares of chunk i (chunk = ceil(n / parts)), then item 0 their sum in order of i
//   muon_scale:      y[g*ld + j] = x[offs[g] + j] * scale[g]                  (X0 = U / max(||U||_F, eps))
//   muon_poly:       P[j] = c A A[j] + (b A[j] + a I), P holding c A A (the batched GEMM's), r x r matrices
//                    ld >= r*r floats apart, j < total = count * ld     (X' = a X + (b A + c A A) X = P X)
//   muon_update:     p[offs[g] + j] = p[offs[g] + j] * decay - lr_adj * o[g*ld + j]  (decay = 1 - lr wd; o: NS's)
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

#define NORM_PARTS_MAX 256

__kernel void muon_norms(const int n, const int chunk, const float eps, __global const int* offs,
                         __global const float* x, __global float* scale)
{
    __local float part[NORM_PARTS_MAX];
    const int i = get_local_id(0), parts = get_local_size(0), g = get_group_id(0);
    const int lo = i * chunk, hi = min(n, lo + chunk);
    __global const float* xg = x + offs[g];
    float s = 0.0f;
    for (int j = lo; j < hi; j++) s += xg[j] * xg[j];
    part[i] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (i != 0) return;
    float t = 0.0f;
    for (int k = 0; k < parts; k++) t += part[k];
    scale[g] = 1.0f / fmax(sqrt(t), eps);
}

__kernel void muon_scale(const int n, const int ld, __global const int* offs, __global const float* x,
                         __global const float* scale, __global float* y)
{
    const int j = get_global_id(0), g = get_global_id(1);
    if (j < n) y[(long)g * ld + j] = x[offs[g] + j] * scale[g];
}

__kernel void muon_poly(const int total, const int r, const int ld, const float a, const float b,
                        __global const float* A, __global float* P)
{
    const int j = get_global_id(0);
    const int k = j % ld;
    if (j >= total || k >= r * r) return;
    const float q = b * A[j] + (k / r == k % r ? a : 0.0f);
    P[j] = P[j] + q;
}

__kernel void muon_update(const int n, const int ld, __global const int* offs, __global float* p,
                          __global const float* o, const float decay, const float lr_adj)
{
    const int j = get_global_id(0), g = get_global_id(1);
    if (j < n) p[offs[g] + j] = p[offs[g] + j] * decay - lr_adj * o[(long)g * ld + j];
}

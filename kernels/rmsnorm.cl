// RMSNorm over C channels, no bias, eps EPS.  -D: C, EPS
//   forward:  out (N,C) = x * rstd * w,  rstd = 1/sqrt(mean_c(x^2) + EPS); saves rstd (N)
//   backward: dx (N,C) [+]= rstd * (dn - xhat * mean_c(dn * xhat)),  dn = dout * w,  xhat = x * rstd
//             dw (C) += sum_n dout * xhat
// One work-item per row (per channel for dw), sums in a fixed order: deterministic.
#ifndef C
#error "C (channels) must be defined"
#endif
#ifndef EPS
#define EPS 1e-5f
#endif

__kernel void rmsnorm_forward(const int N, __global const float* x, __global const float* w,
                              __global float* out, __global float* rstd)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* xr = x + n * C;
    float ss = 0.0f;
    for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
    const float s = 1.0f / sqrt(ss / C + EPS);
    __global float* o = out + n * C;
    for (int c = 0; c < C; c++) o[c] = xr[c] * s * w[c];
    rstd[n] = s;
}

// dx overwrite (accum == 0) or accumulate (accum != 0): the residual stream's gradient adds up.
__kernel void rmsnorm_backward(const int N, const int accum, __global const float* dout,
                               __global const float* x, __global const float* w,
                               __global const float* rstd, __global float* dx)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* xr = x + n * C;
    __global const float* dr = dout + n * C;
    const float s = rstd[n];
    float dot = 0.0f;
    for (int c = 0; c < C; c++) dot += dr[c] * w[c] * xr[c] * s;
    dot /= C;
    __global float* o = dx + n * C;
    for (int c = 0; c < C; c++) {
        const float g = s * (dr[c] * w[c] - xr[c] * s * dot);
        o[c] = accum ? o[c] + g : g;
    }
}

__kernel void rmsnorm_param_backward(const int N, __global const float* dout, __global const float* x,
                                     __global const float* rstd, __global float* dw)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    float sw = 0.0f;
    for (int n = 0; n < N; n++) sw += dout[n * C + c] * x[n * C + c] * rstd[n];
    dw[c] += sw;
}

// GPUs: dw in two stages with fixed orders: part[r*C + c] = the sum over rows [r*rc, (r+1)*rc) (2-D launch
// (c, r)); then dw[c] += sum_r in order.
__kernel void rmsnorm_param_partial(const int N, const int rc, __global const float* dout,
                                    __global const float* x, __global const float* rstd, __global float* part)
{
    const int c = get_global_id(0), r = get_global_id(1);
    if (c >= C || r * rc >= N) return;
    const int hi = min(N, (r + 1) * rc);
    float sw = 0.0f;
    for (int n = r * rc; n < hi; n++) sw += dout[n * C + c] * x[n * C + c] * rstd[n];
    part[r * C + c] = sw;
}

__kernel void rmsnorm_param_final(const int R, __global const float* part, __global float* dw)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    float sw = 0.0f;
    for (int r = 0; r < R; r++) sw += part[r * C + c];
    dw[c] += sw;
}

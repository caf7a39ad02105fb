// LayerNorm over C channels, biased variance, eps EPS.  -D: C, EPS
//   forward:  out (N,C) = (x - mean) * rstd * w + b,  rstd = 1/sqrt(var + EPS); saves mean, rstd (N)
//   backward: dx (N,C) [+]= rstd * (dn - mean_c(dn) - xhat * mean_c(dn * xhat)),  dn = dout * w
//             dw (C) += sum_n dout * xhat,  db (C) += sum_n dout
#ifndef C
#error "C (channels) must be defined"
#endif
#ifndef EPS
#define EPS 1e-5f
#endif

__kernel void layernorm_forward(const int N, __global const float* x, __global const float* w,
                                __global const float* b, __global float* out,
                                __global float* mean, __global float* rstd)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* xr = x + n * C;
    float m = 0.0f;
    for (int c = 0; c < C; c++) m += xr[c];
    m /= C;
    float v = 0.0f;
    for (int c = 0; c < C; c++) { const float d = xr[c] - m; v += d * d; }
    v /= C;
    const float s = 1.0f / sqrt(v + EPS);
    __global float* o = out + n * C;
    for (int c = 0; c < C; c++) o[c] = (xr[c] - m) * s * w[c] + b[c];
    mean[n] = m;
    rstd[n] = s;
}

// dx overwrite (accum == 0) or accumulate (accum != 0): the residual stream's gradient adds up.
__kernel void layernorm_backward(const int N, const int accum, __global const float* dout,
                                 __global const float* x, __global const float* w,
                                 __global const float* mean, __global const float* rstd,
                                 __global float* dx)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* xr = x + n * C;
    __global const float* dr = dout + n * C;
    const float m = mean[n], s = rstd[n];
    float dsum = 0.0f, dxsum = 0.0f;
    for (int c = 0; c < C; c++) {
        const float dn = dr[c] * w[c];
        dsum += dn;
        dxsum += dn * (xr[c] - m) * s;
    }
    dsum /= C;
    dxsum /= C;
    __global float* o = dx + n * C;
    for (int c = 0; c < C; c++) {
        const float xhat = (xr[c] - m) * s;
        const float g = s * (dr[c] * w[c] - dsum - xhat * dxsum);
        o[c] = accum ? o[c] + g : g;
    }
}

// One work-item per channel, rows in order: deterministic.
__kernel void layernorm_param_backward(const int N, __global const float* dout, __global const float* x,
                                       __global const float* mean, __global const float* rstd,
                                       __global float* dw, __global float* db)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int n = 0; n < N; n++) {
        const float d = dout[n * C + c];
        sw += d * (x[n * C + c] - mean[n]) * rstd[n];
        sb += d;
    }
    dw[c] += sw;
    db[c] += sb;
}

// ---- GPUs: one work-group of LW work-items per row, fixed-order tree reductions (deterministic) ----
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void layernorm_forward_wg(const int N, __global const float* x, __global const float* w,
                          __global const float* b, __global float* out,
                          __global float* mean, __global float* rstd)
{
    const int n = get_group_id(0), l = get_local_id(0);
    __local float red[LW];
    __global const float* xr = x + (size_t)n * C;
    float m = 0.0f;
    for (int c = l; c < C; c += LW) m += xr[c];
    m = wg_sum(red, m) / C;
    float v = 0.0f;
    for (int c = l; c < C; c += LW) { const float d = xr[c] - m; v += d * d; }
    v = wg_sum(red, v) / C;
    const float s = 1.0f / sqrt(v + EPS);
    __global float* o = out + (size_t)n * C;
    for (int c = l; c < C; c += LW) o[c] = (xr[c] - m) * s * w[c] + b[c];
    if (l == 0) { mean[n] = m; rstd[n] = s; }
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void layernorm_backward_wg(const int N, const int accum, __global const float* dout,
                           __global const float* x, __global const float* w,
                           __global const float* mean, __global const float* rstd,
                           __global float* dx)
{
    const int n = get_group_id(0), l = get_local_id(0);
    __local float red[LW];
    __global const float* xr = x + (size_t)n * C;
    __global const float* dr = dout + (size_t)n * C;
    const float m = mean[n], s = rstd[n];
    float dsum = 0.0f, dxsum = 0.0f;
    for (int c = l; c < C; c += LW) {
        const float dn = dr[c] * w[c];
        dsum += dn;
        dxsum += dn * (xr[c] - m) * s;
    }
    dsum = wg_sum(red, dsum) / C;
    dxsum = wg_sum(red, dxsum) / C;
    __global float* o = dx + (size_t)n * C;
    for (int c = l; c < C; c += LW) {
        const float xhat = (xr[c] - m) * s;
        const float g = s * (dr[c] * w[c] - dsum - xhat * dxsum);
        o[c] = accum ? o[c] + g : g;
    }
}

// dw, db in two stages with fixed orders: part[(2r)*C + c], part[(2r+1)*C + c] = the sums over rows
// [r*rc, (r+1)*rc) (2-D launch (c, r)); then dw[c] += sum_r in order, db likewise.
__kernel void layernorm_param_partial(const int N, const int rc, __global const float* dout,
                                      __global const float* x, __global const float* mean,
                                      __global const float* rstd, __global float* part)
{
    const int c = get_global_id(0), r = get_global_id(1);
    if (c >= C || r * rc >= N) return;
    const int hi = min(N, (r + 1) * rc);
    float sw = 0.0f, sb = 0.0f;
    for (int n = r * rc; n < hi; n++) {
        const float d = dout[n * C + c];
        sw += d * (x[n * C + c] - mean[n]) * rstd[n];
        sb += d;
    }
    part[(2 * r) * C + c] = sw;
    part[(2 * r + 1) * C + c] = sb;
}

__kernel void layernorm_param_final(const int R, __global const float* part, __global float* dw, __global float* db)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int r = 0; r < R; r++) {
        sw += part[(2 * r) * C + c];
        sb += part[(2 * r + 1) * C + c];
    }
    dw[c] += sw;
    db[c] += sb;
}

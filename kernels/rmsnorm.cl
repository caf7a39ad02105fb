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
// CPUs (-DRB=8 -DCB=16, clgpt/tuning.py's norm_rb, norm_cb): the rows' sums of 8 rows a work-item as one float8,
// 8x8 blocks turned in registers (RMS_TR, C % 8 == 0); dw 16 channels a work-item as one float16 (RMS_CV,
// C % 16 == 0). Each lane sums in the order of the one-row (one-channel) form, with the same operations: the
// same bits.
#ifndef RB
#define RB 1
#endif
#ifndef CB
#define CB 1
#endif
#if RB == 8 && C % 8 == 0
#define RMS_TR 1
#endif
#if CB == 16 && C % 16 == 0
#define RMS_CV 1
#endif
#if defined(RMS_TR) || defined(RMS_CV)
#include "transpose8.cl"
#endif

__kernel void rmsnorm_forward(const int N, __global const float* x, __global const float* w,
                              __global float* out, __global float* rstd)
{
#ifdef RMS_TR
    const int n0 = get_global_id(0) * 8;
    if (n0 >= N) return;
    __global const float* xr[8];  // rows past N repeat the last one; their results are not stored
#pragma unroll
    for (int i = 0; i < 8; i++) xr[i] = x + min(n0 + i, N - 1) * C;
    float8 ss = 0.0f, r[8];
    for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) r[i] = VLD8(xr[i] + c);
        tr8_rows(r);
#pragma unroll
        for (int j = 0; j < 8; j++) ss += r[j] * r[j];
    }
    const float8 sv = 1.0f / sqrt(ss / C + EPS);
    const float* sl = (const float*)&sv;
    for (int i = 0; i < 8 && n0 + i < N; i++) {
        const float s = sl[i];
        __global float* o = out + (n0 + i) * C;
        for (int c = 0; c < C; c += 8) VST8(o + c, VLD8(xr[i] + c) * s * VLD8(w + c));
        rstd[n0 + i] = s;
    }
#else
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* xr = x + n * C;
    float ss = 0.0f;
    for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
    const float s = 1.0f / sqrt(ss / C + EPS);
    __global float* o = out + n * C;
    for (int c = 0; c < C; c++) o[c] = xr[c] * s * w[c];
    rstd[n] = s;
#endif
}

// dx overwrite (accum == 0) or accumulate (accum != 0): the residual stream's gradient adds up.
__kernel void rmsnorm_backward(const int N, const int accum, __global const float* dout,
                               __global const float* x, __global const float* w,
                               __global const float* rstd, __global float* dx)
{
#ifdef RMS_TR
    const int n0 = get_global_id(0) * 8;
    if (n0 >= N) return;
    __global const float* xr[8];
    __global const float* dr[8];
    float sa[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int n = min(n0 + i, N - 1);
        xr[i] = x + n * C; dr[i] = dout + n * C; sa[i] = rstd[n];
    }
    const float8 sv = (float8)(sa[0], sa[1], sa[2], sa[3], sa[4], sa[5], sa[6], sa[7]);
    float8 dot = 0.0f, rx[8], rd[8];
    for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) { rx[i] = VLD8(xr[i] + c); rd[i] = VLD8(dr[i] + c); }
        tr8_rows(rx);
        tr8_rows(rd);
#pragma unroll
        for (int j = 0; j < 8; j++) dot += rd[j] * w[c + j] * rx[j] * sv;
    }
    dot /= C;
    const float* dl = (const float*)&dot;
    for (int i = 0; i < 8 && n0 + i < N; i++) {
        const float s = sa[i], d = dl[i];
        __global float* o = dx + (n0 + i) * C;
        for (int c = 0; c < C; c += 8) {
            const float8 g = s * (VLD8(dr[i] + c) * VLD8(w + c) - VLD8(xr[i] + c) * s * d);
            VST8(o + c, accum ? VLD8(o + c) + g : g);
        }
    }
#else
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
#endif
}

__kernel void rmsnorm_param_backward(const int N, __global const float* dout, __global const float* x,
                                     __global const float* rstd, __global float* dw)
{
#ifdef RMS_CV
    const int c0 = get_global_id(0) * 16;
    if (c0 >= C) return;
    float16 sw = 0.0f;
    for (int n = 0; n < N; n++) sw += VLD16(dout + n * C + c0) * VLD16(x + n * C + c0) * rstd[n];
    VST16(dw + c0, VLD16(dw + c0) + sw);
#else
    const int c = get_global_id(0) * CB;  // CB > 1 without RMS_CV: channel c only (C % 16 != 0)
    if (c >= C) return;
    for (int j = c; j < min(c + CB, C); j++) {
        float sw = 0.0f;
        for (int n = 0; n < N; n++) sw += dout[n * C + j] * x[n * C + j] * rstd[n];
        dw[j] += sw;
    }
#endif
}

// ---- GPUs: one work-group of LW work-items per row (-DLW), fixed-order tree reductions (deterministic; another
// order of summation than the one-work-item forms above, as layernorm.cl's _wg kernels) ----
#ifdef LW
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void rmsnorm_forward_wg(const int N, __global const float* x, __global const float* w, __global float* out,
                        __global float* rstd)
{
    const int n = get_group_id(0), l = get_local_id(0);
    __local float red[LW];
    __global const float* xr = x + (size_t)n * C;
    float ss = 0.0f;
    for (int c = l; c < C; c += LW) ss += xr[c] * xr[c];
    ss = wg_sum(red, ss);
    const float s = 1.0f / sqrt(ss / C + EPS);
    __global float* o = out + (size_t)n * C;
    for (int c = l; c < C; c += LW) o[c] = xr[c] * s * w[c];
    if (l == 0) rstd[n] = s;
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void rmsnorm_backward_wg(const int N, const int accum, __global const float* dout, __global const float* x,
                         __global const float* w, __global const float* rstd, __global float* dx)
{
    const int n = get_group_id(0), l = get_local_id(0);
    __local float red[LW];
    __global const float* xr = x + (size_t)n * C;
    __global const float* dr = dout + (size_t)n * C;
    const float s = rstd[n];
    float dot = 0.0f;
    for (int c = l; c < C; c += LW) dot += dr[c] * w[c] * xr[c] * s;
    dot = wg_sum(red, dot) / C;
    __global float* o = dx + (size_t)n * C;
    for (int c = l; c < C; c += LW) {
        const float g = s * (dr[c] * w[c] - xr[c] * s * dot);
        o[c] = accum ? o[c] + g : g;
    }
}
#endif

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

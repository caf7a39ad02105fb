// RMSNorm over C channels, no bias, eps EPS.  -D: C, EPS
//   forward:  out (N,C) = x * rstd * w,  rstd = 1/sqrt(mean_c(x^2) + EPS); saves rstd (N)
//   backward: dx (N,C) [+]= rstd * (dn - xhat * mean_c(dn * xhat)),  dn = dout * w,  xhat = x * rstd
//             dw (C) += sum_n dout * xhat
// One work-item per row (per channel for dw) on CPUs; on GPUs a work-group a row (-D LW) or, C % 128 == 0, a
// 32-work-item slice a row (-D RW), dw in two stages. Sums in fixed orders throughout: deterministic.
#ifndef C
#error "C (channels) must be defined"
#endif
#ifndef EPS
#define EPS 1e-5f
#endif
// CPUs (-DRB=8 -DCB=16, clgpt/device/tuning.py's norm_rb, norm_cb): the rows' sums of 8 rows a work-item as one float8,
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

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
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

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
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

// ---- GPUs, C % 128 == 0 (-D RW): a row a 32-work-item slice, RW rows a work-group, as layernorm.cl's _rows
// kernels (norm_rows.cl: the slice layout, the in-order row sums, the dw parts) ----
#ifdef RW
#include "norm_rows.cl"

// out, rstd as rmsnorm_forward_wg. 2-D launch: global (32, ceil(N / RW) * RW), local (32, RW); row
// get_group_id(1) * RW + get_local_id(1). One pass over the registers (sum x^2), one barrier (none with SUBGROUP
// 32: norm_rows.cl). Rows past N read the last row and store nothing.
// RMS_TILED 1 (N a multiple of 64): also out's bf16 copy in matmul_wgmma.cl's tiled layout (precision.cl
// tiled_chunk, Rp = N), the copy the products read, as layernorm.cl's LN_TILED (no second pass over out).
#ifndef RMS_TILED
#define RMS_TILED 0
#endif
#if RMS_TILED
#include "precision.cl"
#define RMS_TILED_ARGS , __global uint2* out16
#else
#define RMS_TILED_ARGS
#endif
__kernel __attribute__((reqd_work_group_size(32, RW, 1))) ROW_KERNEL
void rmsnorm_forward_rows(const int N, __global const float* x, __global const float* w, __global float* out,
                          __global float* rstd RMS_TILED_ARGS)
{
    const int l = get_local_id(0), r = get_local_id(1), n = get_group_id(1) * RW + r;
    __local float pq[RW * 32] __attribute__((aligned(16)));
    __global const float4* xr = (__global const float4*)(x + (size_t)min(n, N - 1) * C) + l;
    float4 v[ROW_NB];
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        v[i] = xr[32 * i];
        q += v[i].x * v[i].x; q += v[i].y * v[i].y; q += v[i].z * v[i].z; q += v[i].w * v[i].w;
    }
    const float qp = row_part(q);
    ROW_PUT(pq + r * 32, l, qp);
    ROW_BARRIER();
    const float s = 1.0f / sqrt(ROW_SUM(pq + r * 32, qp) / C + EPS);
    if (n >= N) return;
    __global float4* o = (__global float4*)(out + (size_t)n * C) + l;
    __global const float4* w4 = (__global const float4*)w + l;
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        const float4 y = v[i] * s * w4[32 * i];
        o[32 * i] = y;
#if RMS_TILED
        tiled_store4(out16, n, 4 * l + 128 * i, N, y);
#endif
    }
    if (l == 0) rstd[n] = s;
}

// dx as rmsnorm_backward_wg (overwrite, or add when accum != 0), and dw's partial sums, in one pass as
// layernorm_backward_rows: work-group g covers rows [g * RW * rpi, (g + 1) * RW * rpi), row-slot r (local id 1)
// the rows g * RW * rpi + r + RW k, k < rpi, in order; each work-item keeps a row's x, dout in registers (the
// next row's x, dout, rstd loads issued before this row's barrier) and sums dout * xhat over its slot's rows for
// its columns. The slots' sums are then added in order r = 0..RW-1 through local memory into part[g * C + c].
// 2-D launch: global (32, ceil(N / (RW rpi)) * RW), local (32, RW). One barrier a row: the per-row partials
// alternate between two local buffers (a buffer is written again only after the next row's barrier, which every
// work-item reaches after reading it). Rows past N read the last row and add or store nothing.
// DX_TILED 1 (N a multiple of 64): also dx's bf16 copy beside the values stored, as RMS_TILED's (norm_rows.cl).
__kernel __attribute__((reqd_work_group_size(32, RW, 1))) ROW_KERNEL
void rmsnorm_backward_rows(const int N, const int rpi, const int accum, __global const float* dout,
                           __global const float* x, __global const float* w, __global const float* rstd,
                           __global float* dx, __global float* part DX_TILED_ARGS)
{
    const int l = get_local_id(0), r = get_local_id(1), t = r * 32 + l, g = get_group_id(1);
    __local float red[2][RW * 32] __attribute__((aligned(16)));  // sum(dn * xhat) partials, two rows' worth
    __local float4 cw[RW * 32];
    __global const float4* x4 = (__global const float4*)x + l;
    __global const float4* d4 = (__global const float4*)dout + l;
    float4 wv[ROW_NB], xv[ROW_NB], dv[ROW_NB], aw[ROW_NB];
    int n = g * RW * rpi + r, nc = min(n, N - 1);
    float s = rstd[nc];
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        wv[i] = ((__global const float4*)w)[l + 32 * i];
        xv[i] = x4[(size_t)nc * (C / 4) + 32 * i];
        dv[i] = d4[(size_t)nc * (C / 4) + 32 * i];
        aw[i] = 0.0f;
    }
    for (int k = 0; k < rpi; k++, n += RW) {
        float px = 0.0f;
#pragma unroll
        for (int i = 0; i < ROW_NB; i++) {
            const float4 dnx = dv[i] * wv[i] * (xv[i] * s);
            px += dnx.x; px += dnx.y; px += dnx.z; px += dnx.w;
        }
        __local float* rx = red[k & 1];
        const float spx = row_part(px);
        ROW_PUT(rx + r * 32, l, spx);
        float4 xn[ROW_NB], dnn[ROW_NB];  // the slot's next row, loading while this one's sum is made
        float sn = s;
        if (k + 1 < rpi) {
            const int nn = min(n + RW, N - 1);
            sn = rstd[nn];
#pragma unroll
            for (int i = 0; i < ROW_NB; i++) {
                xn[i] = x4[(size_t)nn * (C / 4) + 32 * i];
                dnn[i] = d4[(size_t)nn * (C / 4) + 32 * i];
            }
        }
        ROW_BARRIER();
        const float dot = ROW_SUM(rx + r * 32, spx) / C;
        if (n < N) {
            __global float4* o = (__global float4*)dx + (size_t)n * (C / 4) + l;
#pragma unroll
            for (int i = 0; i < ROW_NB; i++) {
                const float4 xh = xv[i] * s;
                const float4 gi = s * (dv[i] * wv[i] - xh * dot);
#if DX_TILED
                const float4 v = accum ? o[32 * i] + gi : gi;
                o[32 * i] = v;
                tiled_store4(dx16, n, 4 * l + 128 * i, N, v);
#else
                o[32 * i] = accum ? o[32 * i] + gi : gi;
#endif
                aw[i] += dv[i] * xh;
            }
        }
        s = sn;
#pragma unroll
        for (int i = 0; i < ROW_NB; i++) { xv[i] = xn[i]; dv[i] = dnn[i]; }
    }
    // the slots' sums, 128 columns at a time, in order r = 0..RW-1
    __global float4* pw = (__global float4*)part + (size_t)g * (C / 4);
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) slot_sums_to_part(1, t, i, aw[i], aw[i], cw, cw, pw);
}

// dw += the P parts of rmsnorm_backward_rows, in a fixed order (norm_rows.cl parts_sum). 2-D launch:
// global (C / 4, 32), local (8, 32).
__kernel __attribute__((reqd_work_group_size(8, 32, 1)))
void rmsnorm_param_final_rows(const int P, __global const float* part, __global float* dw)
{
    __local float4 red[32 * 8];
    parts_sum(P, 1, part, dw, dw, red);
}
#endif

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

// The one-work-item forms (CPUs): RB rows a work-item (forward, backward) or CB channels (dw, db). Each row's (or
// channel's) sums run over c (or n) in order as with one a work-item; RB or CB of them side by side are independent
// chains, which a CPU overlaps (one alone waits out each add's latency). The same bits whatever RB and CB.
#ifndef RB
#define RB 1
#endif
#ifndef CB
#define CB 1
#endif
// RB == 8 with C % 8 == 0 (CPUs): the rows' sums as one float8 of 8 rows, 8x8 blocks turned in registers
// (LN_TR); CB == 8 or 16 with C % CB == 0: CB channels a work-item as one vector (LN_CV). Each lane sums in the
// order one row (channel) alone does, with the same operations: the same bits.
#if RB == 8 && C % 8 == 0
#define LN_TR 1
#endif
#if (CB == 8 || CB == 16) && C % CB == 0
#define LN_CV 1
#endif
#if defined(LN_TR) || defined(LN_CV)
#include "transpose8.cl"
#endif

__kernel void layernorm_forward(const int N, __global const float* x, __global const float* w,
                                __global const float* b, __global float* out,
                                __global float* mean, __global float* rstd)
{
    const int n0 = get_global_id(0) * RB;
    if (n0 >= N) return;
#ifdef LN_TR
    __global const float* xr[8];  // rows past N repeat the last one; their results are not stored
#pragma unroll
    for (int i = 0; i < 8; i++) xr[i] = x + min(n0 + i, N - 1) * C;
    float8 mv = 0.0f, vv = 0.0f, r[8];
    for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) r[i] = VLD8(xr[i] + c);
        tr8_rows(r);
#pragma unroll
        for (int j = 0; j < 8; j++) mv += r[j];
    }
    mv /= C;
    for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) r[i] = VLD8(xr[i] + c);
        tr8_rows(r);
#pragma unroll
        for (int j = 0; j < 8; j++) { const float8 d = r[j] - mv; vv += d * d; }
    }
    float8 sv = 1.0f / sqrt(vv / C + EPS);
    const float* ml = (const float*)&mv;
    const float* sl = (const float*)&sv;
    for (int i = 0; i < 8 && n0 + i < N; i++) {
        const float m = ml[i], s = sl[i];
        __global float* o = out + (n0 + i) * C;
        for (int c = 0; c < C; c += 8) VST8(o + c, (VLD8(xr[i] + c) - m) * s * VLD8(w + c) + VLD8(b + c));
        mean[n0 + i] = m;
        rstd[n0 + i] = s;
    }
#else
    int row[RB];  // rows past N repeat the last one; their results are not stored
    float m[RB], v[RB];
#pragma unroll
    for (int i = 0; i < RB; i++) { row[i] = min(n0 + i, N - 1) * C; m[i] = 0.0f; v[i] = 0.0f; }
    for (int c = 0; c < C; c++)
#pragma unroll
        for (int i = 0; i < RB; i++) m[i] += x[row[i] + c];
#pragma unroll
    for (int i = 0; i < RB; i++) m[i] /= C;
    for (int c = 0; c < C; c++)
#pragma unroll
        for (int i = 0; i < RB; i++) { const float d = x[row[i] + c] - m[i]; v[i] += d * d; }
    for (int i = 0; i < RB && n0 + i < N; i++) {
        const float s = 1.0f / sqrt(v[i] / C + EPS);
        __global const float* xr = x + row[i];
        __global float* o = out + row[i];
        for (int c = 0; c < C; c++) o[c] = (xr[c] - m[i]) * s * w[c] + b[c];
        mean[n0 + i] = m[i];
        rstd[n0 + i] = s;
    }
#endif
}

// dx overwrite (accum == 0) or accumulate (accum != 0): the residual stream's gradient adds up.
__kernel void layernorm_backward(const int N, const int accum, __global const float* dout,
                                 __global const float* x, __global const float* w,
                                 __global const float* mean, __global const float* rstd,
                                 __global float* dx)
{
    const int n0 = get_global_id(0) * RB;
    if (n0 >= N) return;
#ifdef LN_TR
    __global const float* xr[8];
    __global const float* dr[8];
    float ma[8], sa[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int n = min(n0 + i, N - 1);
        xr[i] = x + n * C; dr[i] = dout + n * C; ma[i] = mean[n]; sa[i] = rstd[n];
    }
    const float8 mv = (float8)(ma[0], ma[1], ma[2], ma[3], ma[4], ma[5], ma[6], ma[7]);
    const float8 sv = (float8)(sa[0], sa[1], sa[2], sa[3], sa[4], sa[5], sa[6], sa[7]);
    float8 dsum = 0.0f, dxsum = 0.0f, rx[8], rd[8];
    for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) { rx[i] = VLD8(xr[i] + c); rd[i] = VLD8(dr[i] + c); }
        tr8_rows(rx);
        tr8_rows(rd);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float8 dn = rd[j] * w[c + j];
            dsum += dn;
            dxsum += dn * (rx[j] - mv) * sv;
        }
    }
    const float* dsl = (const float*)&dsum;
    const float* dxl = (const float*)&dxsum;
    for (int i = 0; i < 8 && n0 + i < N; i++) {
        const float ds = dsl[i] / C, dxs = dxl[i] / C, m = ma[i], s = sa[i];
        __global float* o = dx + (n0 + i) * C;
        for (int c = 0; c < C; c += 8) {
            const float8 xhat = (VLD8(xr[i] + c) - m) * s;
            const float8 g = s * (VLD8(dr[i] + c) * VLD8(w + c) - ds - xhat * dxs);
            VST8(o + c, accum ? VLD8(o + c) + g : g);
        }
    }
#else
    int row[RB];
    float m[RB], s[RB], dsum[RB], dxsum[RB];
#pragma unroll
    for (int i = 0; i < RB; i++) {
        const int n = min(n0 + i, N - 1);
        row[i] = n * C; m[i] = mean[n]; s[i] = rstd[n]; dsum[i] = 0.0f; dxsum[i] = 0.0f;
    }
    for (int c = 0; c < C; c++)
#pragma unroll
        for (int i = 0; i < RB; i++) {
            const float dn = dout[row[i] + c] * w[c];
            dsum[i] += dn;
            dxsum[i] += dn * (x[row[i] + c] - m[i]) * s[i];
        }
    for (int i = 0; i < RB && n0 + i < N; i++) {
        const float ds = dsum[i] / C, dxs = dxsum[i] / C;
        __global const float* xr = x + row[i];
        __global const float* dr = dout + row[i];
        __global float* o = dx + row[i];
        for (int c = 0; c < C; c++) {
            const float xhat = (xr[c] - m[i]) * s[i];
            const float g = s[i] * (dr[c] * w[c] - ds - xhat * dxs);
            o[c] = accum ? o[c] + g : g;
        }
    }
#endif
}

// CB channels a work-item, rows in order: deterministic.
__kernel void layernorm_param_backward(const int N, __global const float* dout, __global const float* x,
                                       __global const float* mean, __global const float* rstd,
                                       __global float* dw, __global float* db)
{
    const int c0 = get_global_id(0) * CB;
    if (c0 >= C) return;
#ifdef LN_CV
#if CB == 16
#define VLDC VLD16
#define VSTC VST16
    float16 sw = 0.0f, sb = 0.0f;
#else
#define VLDC VLD8
#define VSTC VST8
    float8 sw = 0.0f, sb = 0.0f;
#endif
    for (int n = 0; n < N; n++) {
        const float m = mean[n], s = rstd[n];
        const __global float* dp = dout + n * C + c0;
        const __global float* xp = x + n * C + c0;
        sw += VLDC(dp) * (VLDC(xp) - m) * s;
        sb += VLDC(dp);
    }
    VSTC(dw + c0, VLDC(dw + c0) + sw);
    VSTC(db + c0, VLDC(db + c0) + sb);
#else
    float sw[CB], sb[CB];
#pragma unroll
    for (int j = 0; j < CB; j++) { sw[j] = 0.0f; sb[j] = 0.0f; }
    for (int n = 0; n < N; n++) {
        const float m = mean[n], s = rstd[n];
#pragma unroll
        for (int j = 0; j < CB; j++) {
            const int c = min(c0 + j, C - 1);
            const float d = dout[n * C + c];
            sw[j] += d * (x[n * C + c] - m) * s;
            sb[j] += d;
        }
    }
    for (int j = 0; j < CB && c0 + j < C; j++) {
        dw[c0 + j] += sw[j];
        db[c0 + j] += sb[j];
    }
#endif
}

// ---- GPUs: one work-group of LW work-items per row, fixed-order tree reductions (deterministic) ----
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
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

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
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

// ---- GPUs, C % 128 == 0 (-D RW): a row a 32-work-item slice, RW rows a work-group (norm_rows.cl: the slice
// layout, the in-order row sums, the dw, db parts; rmsnorm.cl's _rows kernels share them) ----
#ifdef RW
#include "norm_rows.cl"

// out, mean, rstd as layernorm_forward_wg. 2-D launch: global (32, ceil(N / RW) * RW), local (32, RW); row
// get_group_id(1) * RW + get_local_id(1). Two passes over the registers (mean, then sum (x - mean)^2) with a
// local array each: two barriers in all (none with SUBGROUP 32: norm_rows.cl). Rows past N read the last row and
// store nothing.
// LN_TILED 1 (N a multiple of 64): also out's bf16 copy in matmul_wgmma.cl's tiled layout (precision.cl
// tiled_chunk, Rp = N), the copy the products read (Ops keeps it: no second pass over out to make it).
#ifndef LN_TILED
#define LN_TILED 0
#endif
#if LN_TILED
#include "precision.cl"
#define LN_TILED_ARGS , __global uint2* out16
#else
#define LN_TILED_ARGS
#endif
__kernel __attribute__((reqd_work_group_size(32, RW, 1))) ROW_KERNEL
void layernorm_forward_rows(const int N, __global const float* x, __global const float* w,
                            __global const float* b, __global float* out,
                            __global float* mean, __global float* rstd LN_TILED_ARGS)
{
    const int l = get_local_id(0), r = get_local_id(1), n = get_group_id(1) * RW + r;
    __local float ps[RW * 32] __attribute__((aligned(16))), pv[RW * 32] __attribute__((aligned(16)));
    __global const float4* xr = (__global const float4*)(x + (size_t)min(n, N - 1) * C) + l;
    float4 v[ROW_NB];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        v[i] = xr[32 * i];
        s += v[i].x; s += v[i].y; s += v[i].z; s += v[i].w;
    }
    const float sp = row_part(s);
    ROW_PUT(ps + r * 32, l, sp);
    ROW_BARRIER();
    const float m = ROW_SUM(ps + r * 32, sp) / C;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        const float4 d = v[i] - m;
        q += d.x * d.x; q += d.y * d.y; q += d.z * d.z; q += d.w * d.w;
    }
    const float qp = row_part(q);
    ROW_PUT(pv + r * 32, l, qp);
    ROW_BARRIER();
    const float sd = 1.0f / sqrt(ROW_SUM(pv + r * 32, qp) / C + EPS);
    if (n >= N) return;
    __global float4* o = (__global float4*)(out + (size_t)n * C) + l;
    __global const float4* w4 = (__global const float4*)w + l;
    __global const float4* b4 = (__global const float4*)b + l;
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        const float4 y = (v[i] - m) * sd * w4[32 * i] + b4[32 * i];
        o[32 * i] = y;
#if LN_TILED
        tiled_store4(out16, n, 4 * l + 128 * i, N, y);
#endif
    }
    if (l == 0) { mean[n] = m; rstd[n] = sd; }
}

// dx as layernorm_backward_wg (overwrite, or add when accum != 0), and dw, db's partial sums: work-group g
// covers rows [g * RW * rpi, (g + 1) * RW * rpi), row-slot r (local id 1) the rows g * RW * rpi + r + RW k,
// k < rpi, in order; each work-item keeps a row's x, dout in registers (the next row's x, dout, mean, rstd
// loads issued before this row's barrier) and sums dout * xhat, dout over its slot's rows for its columns. The
// slots' sums are then added in order r = 0..RW-1 through local memory into part[g * 2C + c] (dw) and
// part[g * 2C + C + c] (db). 2-D launch: global (32, ceil(N / (RW rpi)) * RW), local (32, RW). One barrier a
// row: the per-row partials alternate between two local buffers (a buffer is written again only after the next
// row's barrier, which every work-item reaches after reading it). Rows past N read the last row and add or
// store nothing.
// DX_TILED 1 (N a multiple of 64): also dx's bf16 copy beside the values stored, as LN_TILED's (norm_rows.cl).
// DX_COLSUM 1 (with DX_TILED): and the column sums of the dx stored, work-group g's in dxpart[g * C + c] (its slots'
// sums added in order, as dw's): the bias gradient of the linear layer whose output gradient dx is (its products
// read the copy), which a pass over dx made with the copy before.
#ifndef DX_COLSUM
#define DX_COLSUM 0
#endif
#if DX_COLSUM && !DX_TILED
#error DX_COLSUM comes with DX_TILED
#endif
#if DX_COLSUM
#define DX_COLSUM_ARGS , __global float* dxpart
#else
#define DX_COLSUM_ARGS
#endif
__kernel __attribute__((reqd_work_group_size(32, RW, 1))) ROW_KERNEL
void layernorm_backward_rows(const int N, const int rpi, const int accum, __global const float* dout,
                             __global const float* x, __global const float* w,
                             __global const float* mean, __global const float* rstd,
                             __global float* dx, __global float* part DX_TILED_ARGS DX_COLSUM_ARGS)
{
    const int l = get_local_id(0), r = get_local_id(1), t = r * 32 + l, g = get_group_id(1);
    __local float red[4][RW * 32] __attribute__((aligned(16)));  // (dsum, dxsum) partials, two rows' worth
    __local float4 cw[RW * 32], cb[RW * 32];
    __global const float4* x4 = (__global const float4*)x + l;
    __global const float4* d4 = (__global const float4*)dout + l;
    float4 wv[ROW_NB], xv[ROW_NB], dv[ROW_NB], aw[ROW_NB], ab[ROW_NB];
    int n = g * RW * rpi + r, nc = min(n, N - 1);
    float m = mean[nc], s = rstd[nc];
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) {
        wv[i] = ((__global const float4*)w)[l + 32 * i];
        xv[i] = x4[(size_t)nc * (C / 4) + 32 * i];
        dv[i] = d4[(size_t)nc * (C / 4) + 32 * i];
        aw[i] = 0.0f;
        ab[i] = 0.0f;
    }
#if DX_COLSUM
    float4 ax[ROW_NB];
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) ax[i] = 0.0f;
#endif
    for (int k = 0; k < rpi; k++, n += RW) {
        float ps = 0.0f, px = 0.0f;
#pragma unroll
        for (int i = 0; i < ROW_NB; i++) {
            const float4 dn = dv[i] * wv[i], dnx = dn * ((xv[i] - m) * s);
            ps += dn.x; ps += dn.y; ps += dn.z; ps += dn.w;
            px += dnx.x; px += dnx.y; px += dnx.z; px += dnx.w;
        }
        __local float* rs = red[2 * (k & 1)];
        __local float* rx = red[2 * (k & 1) + 1];
        const float sps = row_part(ps), spx = row_part(px);
        ROW_PUT(rs + r * 32, l, sps);
        ROW_PUT(rx + r * 32, l, spx);
        float4 xn[ROW_NB], dnn[ROW_NB];  // the slot's next row, loading while this one's sums are made
        float mn = m, sn = s;
        if (k + 1 < rpi) {
            const int nn = min(n + RW, N - 1);
            mn = mean[nn];
            sn = rstd[nn];
#pragma unroll
            for (int i = 0; i < ROW_NB; i++) {
                xn[i] = x4[(size_t)nn * (C / 4) + 32 * i];
                dnn[i] = d4[(size_t)nn * (C / 4) + 32 * i];
            }
        }
        ROW_BARRIER();
        const float ds = ROW_SUM(rs + r * 32, sps) / C, dxs = ROW_SUM(rx + r * 32, spx) / C;
        if (n < N) {
            __global float4* o = (__global float4*)dx + (size_t)n * (C / 4) + l;
#pragma unroll
            for (int i = 0; i < ROW_NB; i++) {
                const float4 xh = (xv[i] - m) * s;
                const float4 gi = s * (dv[i] * wv[i] - ds - xh * dxs);
#if DX_TILED
                const float4 v = accum ? o[32 * i] + gi : gi;
                o[32 * i] = v;
                tiled_store4(dx16, n, 4 * l + 128 * i, N, v);
#if DX_COLSUM
                ax[i] += v;
#endif
#else
                o[32 * i] = accum ? o[32 * i] + gi : gi;
#endif
                aw[i] += dv[i] * xh;
                ab[i] += dv[i];
            }
        }
        m = mn;
        s = sn;
#pragma unroll
        for (int i = 0; i < ROW_NB; i++) { xv[i] = xn[i]; dv[i] = dnn[i]; }
    }
    // the slots' sums, 128 columns at a time: dw's and db's columns in order r = 0..RW-1
    __global float4* pw = (__global float4*)part + (size_t)g * (C / 2);
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) slot_sums_to_part(2, t, i, aw[i], ab[i], cw, cb, pw);
#if DX_COLSUM
    barrier(CLK_LOCAL_MEM_FENCE);  // cw is written again: every work-item has read the last of dw's
    __global float4* px = (__global float4*)dxpart + (size_t)g * (C / 4);
#pragma unroll
    for (int i = 0; i < ROW_NB; i++) slot_sums_to_part(1, t, i, ax[i], ax[i], cw, cb, px);
#endif
}

// dw, db += the P parts of layernorm_backward_rows, in a fixed order (norm_rows.cl parts_sum). 2-D launch:
// global (C / 2, 32), local (8, 32).
__kernel __attribute__((reqd_work_group_size(8, 32, 1)))
void layernorm_param_final_rows(const int P, __global const float* part, __global float* dw, __global float* db)
{
    __local float4 red[32 * 8];
    parts_sum(P, 2, part, dw, db, red);
}
#endif

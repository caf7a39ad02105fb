// Mixture of experts: router, top-k routing, per-expert token lists, gather/combine and their backward.
// -D: E (experts), K (experts used per token), C (channels), RM (tile rows of the grouped products)
// Shapes: N = B*T tokens; rlogits/probs (N,E); sel (N,K) int, w (N,K); pos (N*K) int; counts, offs (E) int,
// tiles (E+1) int, pmean (E); xg / ye / dye / dxg (R, C): expert e's rows at offs[e] .. offs[e]+counts[e]-1.
//   router:   p = softmax(rlogits);  sel = top-k of p, descending, ties to the lower index;
//             w_k = p[sel_k] / sum_j p[sel_j]                (llama.cpp build_moe_ffn, softmax gating, norm_w)
//   route:    expert e's rows hold its tokens in increasing n; pos[n*K+k] = row of (n, k) in xg/ye;
//             pmean[e] = mean_n p[n,e] (for the load-balancing loss E * sum_e f_e pmean_e, f_e = counts_e/(N*K))
//   gather:   xg[pos(n,k)] = x[n];   combine: out[n] = resid[n] + sum_k w[n,k] ye[pos(n,k)]
//   backward: dye[pos(n,k)] = w[n,k] dout[n];  dw[n,k] = dout[n] . ye[pos(n,k)]
//             dp_k = (dw_k - sum_j w_j dw_j) / sum_j p[sel_j]  (+ aux_scale * counts_e on every p[n,e])
//             drlogits = p * (dp - sum_e p dp);   dx[n] += sum_k dxg[pos(n,k)]
// The routing indices are fixed in the backward (the top-k is piecewise constant). Every sum runs in a
// fixed order and every row is written by one work-item: deterministic, no atomics.
#ifndef E
#error "E must be defined"
#endif

// The router of token n from its logits l (E floats, private).
inline void route_token(const int n, const int fixed, const float* l, __global float* probs, __global int* sel,
                        __global float* w)
{
    float p[E];
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = fmax(mx, l[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; e++) { p[e] = exp(l[e] - mx); sum += p[e]; }
    for (int e = 0; e < E; e++) { p[e] /= sum; probs[n * E + e] = p[e]; }
    if (!fixed) {  // fixed != 0 keeps the previous forward's sel (gradient checks)
        int taken[E];
        for (int e = 0; e < E; e++) taken[e] = 0;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            sel[n * K + k] = best;
        }
    }
    float ssel = 0.0f;
    for (int k = 0; k < K; k++) ssel += p[sel[n * K + k]];
    for (int k = 0; k < K; k++) w[n * K + k] = p[sel[n * K + k]] / ssel;
}

__kernel void moe_router_forward(const int N, const int fixed, __global const float* rlogits,
                                 __global float* probs, __global int* sel, __global float* w)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    float l[E];
    for (int e = 0; e < E; e++) l[e] = rlogits[n * E + e];
    route_token(n, fixed, l, probs, sel, w);
}

// GPUs (clgpt/ops/grouped.py moe_router_forward): the logits x[n] . Wr[e] in fp32 as well, 32 work-items a token
// (channels lane, lane + 32, ...), each lane's E sums then added in lane order; launch (32, N), local (32, RW).
#ifdef RW
__kernel __attribute__((reqd_work_group_size(32, RW, 1)))
void moe_router_forward_rows(const int N, const int fixed, __global const float* x, __global const float* wr,
                             __global float* probs, __global int* sel, __global float* w)
{
    __local float part[RW][E][33];
    const int lane = get_local_id(0), ly = get_local_id(1), n = get_global_id(1);
    float s[E];
    for (int e = 0; e < E; e++) s[e] = 0.0f;
    if (n < N)
        for (int c = lane; c < C; c += 32) {
            const float xv = x[(size_t)n * C + c];
            for (int e = 0; e < E; e++) s[e] += xv * wr[e * C + c];
        }
    for (int e = 0; e < E; e++) part[ly][e][lane] = s[e];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane || n >= N) return;
    float l[E];
    for (int e = 0; e < E; e++) {
        float t = 0.0f;
        for (int j = 0; j < 32; j++) t += part[ly][e][j];
        l[e] = t;
    }
    route_token(n, fixed, l, probs, sel, w);
}

// The router weight's gradient in parts: part[p E C + e C + c] = sum over rows n of chunk p (rc rows) of
// drlogits[n, e] x[n, c], rows in order; clgpt/ops/grouped.py adds the parts with bias_final. Launch (C, P).
__kernel void moe_router_dw_partial(const int N, const int rc, __global const float* drl, __global const float* x,
                                    __global float* part)
{
    const int c = get_global_id(0), p = get_global_id(1);
    if (c >= C || p * rc >= N) return;  // (the launch may round P up)
    float s[E];
    for (int e = 0; e < E; e++) s[e] = 0.0f;
    const int end = min(N, (p + 1) * rc);
    for (int n = p * rc; n < end; n++) {
        const float xv = x[(size_t)n * C + c];
        for (int e = 0; e < E; e++) s[e] += drl[n * E + e] * xv;
    }
    for (int e = 0; e < E; e++) part[((size_t)p * E + e) * C + c] = s[e];
}

// dx[n] = drlogits[n] @ Wr + sum_k dxg[pos(n,k)]: the router's input gradient and the gather's together.
__kernel void moe_scatter_router_backward(const int N, __global const int* pos, __global const float* dxg,
                                          __global const float* drl, __global const float* wr, __global float* dx)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    float s = 0.0f;
    for (int e = 0; e < E; e++) s += drl[n * E + e] * wr[e * C + c];
    for (int k = 0; k < K; k++) s += dxg[pos[n * K + k] * C + c];
    dx[n * C + c] = s;
}
#endif

// Packed routing for the grouped products (-D RM: their tile rows): expert e's rows start at offs[e] =
// sum_{e' < e} ceil(counts[e'] / RM) * RM, its tokens in increasing order; tiles[e] = offs[e] / RM and
// tiles[E] the total number of tiles. One work-item per expert (each counts all experts before it).
#ifdef RM
__kernel void moe_route_packed(const int N, __global const float* probs, __global const int* sel,
                               __global int* pos, __global int* counts, __global int* offs,
                               __global int* tiles, __global float* pmean)
{
    const int e = get_global_id(0);
    if (e >= E) return;
    int off = 0;
    for (int e2 = 0; e2 < e; e2++) {
        int c = 0;
        for (int a = 0; a < N * K; a++) c += sel[a] == e2;
        off += (c + RM - 1) / RM * RM;
    }
    int cnt = 0;
    float ps = 0.0f;
    for (int n = 0; n < N; n++) {
        ps += probs[n * E + e];
        for (int k = 0; k < K; k++)
            if (sel[n * K + k] == e) pos[n * K + k] = off + cnt++;
    }
    counts[e] = cnt;
    offs[e] = off;
    tiles[e] = off / RM;
    if (e == E - 1) tiles[E] = (off + (cnt + RM - 1) / RM * RM) / RM;
    pmean[e] = ps / N;
}
#endif

// The same routing as moe_route_packed by one work-group of LW work-items (GPUs, -D LW; a GPU runs one
// work-item's serial loop over all N*K assignments slowly): work-item j takes the assignments
// [j*ch, (j+1)*ch) (ch = ceil(N*K / LW)); its per-expert counts, prefixed over j in order, place its rows. Its
// share of sel comes through local memory RP at a time, the whole group loading them (runs of RP ints), and pos
// goes out the same way: one work-item's serial loads from global memory, a round trip each, were the time.
// pmean: work-item j sums the tokens j, j + LW, ... (coalesced rows), the items' sums then added in order of j.
// Same pos, counts, offs, tiles as moe_route_packed; pmean in another (fixed) order of summation.
#ifdef LW
#include "reduce.cl"
#define RP (2048 / LW)  // assignments a work-item stages at a time (8 KB of local memory for the group)

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void moe_route_packed_wg(const int N, __global const float* probs, __global const int* sel,
                         __global int* pos, __global int* counts, __global int* offs,
                         __global int* tiles, __global float* pmean)
{
    __local int cnt[LW * E];    // cnt[j*E + e]: item j's count of expert e, then the rows before it in e
    __local float ps[LW * E];  // item j's sum of p[n,e] over its tokens
    __local int base[E];
    __local int st[LW * RP];   // staged: item i's RP assignments at st[i*RP ..]
    const int j = get_local_id(0), NK = N * K;
    const int ch = (NK + LW - 1) / LW;
    // counts and sums by compares over every expert, unrolled: c[] and p[] stay in registers
    int c[E];
    float p[E];
#pragma unroll
    for (int e = 0; e < E; e++) { c[e] = 0; p[e] = 0.0f; }
    for (int q = 0; q < ch; q += RP) {
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = j; i < LW * RP; i += LW) {  // item i / RP's assignments q + i % RP
            const int o = q + i % RP, a = (i / RP) * ch + o;
            st[i] = o < ch && a < NK ? sel[a] : -1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int r = 0; r < RP; r++) {
            const int s = st[j * RP + r];
#pragma unroll
            for (int e = 0; e < E; e++) c[e] += s == e;
        }
    }
    for (int n = j; n < N; n += LW)
#pragma unroll
        for (int e = 0; e < E; e++) p[e] += probs[n * E + e];
#pragma unroll
    for (int e = 0; e < E; e++) { cnt[j * E + e] = c[e]; ps[j * E + e] = p[e]; }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (j < E) {  // item e: exclusive prefix of expert e's counts over the items, its total, its pmean
        int run = 0;
        float s = 0.0f;
        for (int i = 0; i < LW; i++) {
            const int v = cnt[i * E + j];
            cnt[i * E + j] = run;
            run += v;
            s += ps[i * E + j];
        }
        counts[j] = run;
        base[j] = run;
        pmean[j] = s / N;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (j == 0) {  // tile-aligned offsets, in order of e
        int off = 0;
        for (int e = 0; e < E; e++) {
            const int n = base[e];
            base[e] = off;
            offs[e] = off;
            tiles[e] = off / RM;
            off += (n + RM - 1) / RM * RM;
        }
        tiles[E] = off / RM;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
    for (int e = 0; e < E; e++) c[e] = base[e] + cnt[j * E + e];
    for (int q = 0; q < ch; q += RP) {
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = j; i < LW * RP; i += LW) {
            const int o = q + i % RP, a = (i / RP) * ch + o;
            st[i] = o < ch && a < NK ? sel[a] : -1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int r = 0; r < RP; r++) {  // this item's rows, in place of their experts
            const int s = st[j * RP + r];
            int row = 0;
#pragma unroll
            for (int e = 0; e < E; e++)
                if (s == e) row = c[e]++;
            st[j * RP + r] = row;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = j; i < LW * RP; i += LW) {
            const int o = q + i % RP, a = (i / RP) * ch + o;
            if (o < ch && a < NK) pos[a] = st[i];
        }
    }
}
#endif

// xg[pos[a]] = x[a / K]: one work-item per (channel, assignment a = n*K + k).
__kernel void moe_gather_packed(const int N, __global const int* pos, __global const float* x, __global float* xg)
{
    const int c = get_global_id(0), a = get_global_id(1);
    if (c >= C || a >= N * K) return;
    xg[pos[a] * C + c] = x[(a / K) * C + c];
}

__kernel void moe_combine_forward(const int N, __global const float* resid, __global const float* w,
                                  __global const int* pos, __global const float* ye, __global float* out)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    float s = resid[n * C + c];
    for (int k = 0; k < K; k++) s += w[n * K + k] * ye[pos[n * K + k] * C + c];
    out[n * C + c] = s;
}

// dye rows of every (n, k): one work-item per (channel, assignment).
__kernel void moe_combine_backward(const int N, __global const float* dout, __global const float* w,
                                   __global const int* pos, __global float* dye)
{
    const int c = get_global_id(0), a = get_global_id(1);
    if (c >= C || a >= N * K) return;
    dye[pos[a] * C + c] = w[a] * dout[(a / K) * C + c];
}

__kernel void moe_weight_backward(const int N, __global const float* dout, __global const int* pos,
                                  __global const float* ye, __global float* dw)
{
    const int a = get_global_id(0);
    if (a >= N * K) return;
    __global const float* d = dout + (a / K) * C;
    __global const float* y = ye + pos[a] * C;
    float s = 0.0f;
    for (int c = 0; c < C; c++) s += d[c] * y[c];
    dw[a] = s;
}

#ifdef LW
// moe_weight_backward with one work-group of LW work-items per assignment a (GPUs: coalesced rows), the
// channel sums in wg_sum's fixed tree order.
__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void moe_weight_backward_wg(const int N, __global const float* dout, __global const int* pos,
                            __global const float* ye, __global float* dw)
{
    __local float red[LW];
    const int a = get_group_id(0), l = get_local_id(0);
    if (a >= N * K) return;
    __global const float* d = dout + (a / K) * C;
    __global const float* y = ye + pos[a] * C;
    float s = 0.0f;
    for (int c = l; c < C; c += LW) s += d[c] * y[c];
    s = wg_sum(red, s);
    if (l == 0) dw[a] = s;
}
#endif

// drlogits (N,E) from dw (N,K); aux_scale = scale * coef * E / (N^2 K), so that aux_scale * counts[e]
// is d(scale * coef * aux)/dp[n,e].
__kernel void moe_router_backward(const int N, const float aux_scale, __global const float* dw,
                                  __global const float* probs, __global const int* sel,
                                  __global const float* w, __global const int* counts,
                                  __global float* drlogits)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* p = probs + n * E;
    float dp[E];
    for (int e = 0; e < E; e++) dp[e] = aux_scale * counts[e];
    float ssel = 0.0f, wdw = 0.0f;
    for (int k = 0; k < K; k++) {
        ssel += p[sel[n * K + k]];
        wdw += w[n * K + k] * dw[n * K + k];
    }
    for (int k = 0; k < K; k++) dp[sel[n * K + k]] += (dw[n * K + k] - wdw) / ssel;
    float dot = 0.0f;
    for (int e = 0; e < E; e++) dot += p[e] * dp[e];
    for (int e = 0; e < E; e++) drlogits[n * E + e] = p[e] * (dp[e] - dot);
}

__kernel void moe_scatter_backward(const int N, __global const int* pos, __global const float* dxg,
                                   __global float* dx)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    float s = dx[n * C + c];
    for (int k = 0; k < K; k++) s += dxg[pos[n * K + k] * C + c];
    dx[n * C + c] = s;
}

// On wgmma (clgpt/ops/grouped.py moe_tiled): gather and the combine's backward write only the bf16 tiled copy
// the grouped products read (precision.cl tiled_store4, Rp rows, a multiple of 64; C a multiple of 4), the same
// values to_bf16 would make of xg / dye. 2-D launch (C/4, N*K): four channels of one assignment a work-item.
#ifdef MOE_TILED
#include "precision.cl"
__kernel void moe_gather_packed_tiled(const int N, const int Rp, __global const int* pos, __global const float* x,
                                      __global uint2* xg16)
{
    const int c = 4 * get_global_id(0), a = get_global_id(1);
    if (c >= C || a >= N * K) return;
    tiled_store4(xg16, pos[a], c, Rp, vload4(0, x + (size_t)(a / K) * C + c));
}

__kernel void moe_combine_backward_tiled(const int N, const int Rp, __global const float* dout,
                                         __global const float* w, __global const int* pos, __global uint2* dye16)
{
    const int c = 4 * get_global_id(0), a = get_global_id(1);
    if (c >= C || a >= N * K) return;
    tiled_store4(dye16, pos[a], c, Rp, w[a] * vload4(0, dout + (size_t)(a / K) * C + c));
}
#endif

// Causal multi-head self-attention.  -D: C, H, D (= C/H), SCALE (= 1/sqrt(D))
// qkv (B,T,3C): q | k | v, head h at columns h*D..(h+1)*D-1 of each; out (B,T,C); att (B,H,T,T).
//   forward:  att[b,h,t,:] = softmax_{t2<=t}(SCALE * q_t . k_t2),  out[b,t,h] = sum_t2 att * v_t2
//   backward: dp = dout_t . v_t2;  ds = att * (dp - sum_t2 att * dp)  (kept in datt)
//             dq_t = SCALE sum_t2 ds k_t2;  dk_t2 = SCALE sum_t ds q_t;  dv_t2 = sum_t att dout_t
// One work-item per (query t | key t2, b*H+h), every sum in a fixed order: deterministic, no atomics.
// -DVEC=1 (CPUs) handles head vectors as D/8 float8 when D is a multiple of 8, else one float at a time:
// explicit vectors keep PoCL from scalarising the per-work-item loops, whose trip counts differ.
#ifndef C
#error "C must be defined"
#endif
#define C3 (3 * C)

#ifndef VEC
#define VEC 0
#endif
#if VEC && D % 8 == 0
#define W 8
typedef float floatw __attribute__((ext_vector_type(8), aligned(4)));
#define HSUM(v) ({ const float4 h4 = (v).lo + (v).hi; const float2 h2 = h4.lo + h4.hi; h2.x + h2.y; })
#else
#define W 1
typedef float floatw;
#define HSUM(v) (v)
#endif
#define DV (D / W)
#define LDW(p, i) (((__global const floatw*)(p))[i])
#define STW(p, i, v) (((__global floatw*)(p))[i] = (v))

__kernel void attention_forward(const int B, const int T, __global const float* qkv,
                                __global float* out, __global float* att)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* q = qkv + (b * T + t) * C3 + h * D;
    __global float* arow = att + (bh * T + t) * T;
    floatw qv[DV];
    for (int d = 0; d < DV; d++) qv[d] = LDW(q, d);
    float mx = -INFINITY;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += qv[d] * LDW(k, d);
        const float sc = HSUM(s) * SCALE;
        arow[t2] = sc;
        mx = fmax(mx, sc);
    }
    float sum = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float e = exp(arow[t2] - mx);
        arow[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
    floatw acc[DV];
    for (int d = 0; d < DV; d++) acc[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float p = arow[t2] * inv;
        arow[t2] = p;
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        for (int d = 0; d < DV; d++) acc[d] += p * LDW(v, d);
    }
    for (int t2 = t + 1; t2 < T; t2++) arow[t2] = 0.0f;
    __global float* o = out + (b * T + t) * C + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, acc[d]);
}

// Per query row: ds into datt, dq into dqkv (overwrites the q part).
__kernel void attention_backward_query(const int B, const int T, __global const float* dout,
                                       __global const float* qkv, __global const float* att,
                                       __global float* datt, __global float* dqkv)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* arow = att + (bh * T + t) * T;
    __global float* drow = datt + (bh * T + t) * T;
    floatw dy[DV];
    for (int d = 0; d < DV; d++) dy[d] = LDW(dout + (b * T + t) * C + h * D, d);
    float sdot = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        floatw s = 0.0f;
        for (int d = 0; d < DV; d++) s += dy[d] * LDW(v, d);
        const float dp = HSUM(s);
        drow[t2] = dp;
        sdot += arow[t2] * dp;
    }
    floatw dq[DV];
    for (int d = 0; d < DV; d++) dq[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float ds = arow[t2] * (drow[t2] - sdot);
        drow[t2] = ds;
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        for (int d = 0; d < DV; d++) dq[d] += ds * LDW(k, d);
    }
    __global float* o = dqkv + (b * T + t) * C3 + h * D;
    for (int d = 0; d < DV; d++) STW(o, d, dq[d] * SCALE);
}

// Per key row t2: dk, dv into dqkv (overwrites the k and v parts). Reads ds from datt.
__kernel void attention_backward_key(const int B, const int T, __global const float* dout,
                                     __global const float* qkv, __global const float* att,
                                     __global const float* datt, __global float* dqkv)
{
    const int t2 = get_global_id(0), bh = get_global_id(1);
    if (t2 >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    floatw dk[DV], dv[DV];
    for (int d = 0; d < DV; d++) { dk[d] = 0.0f; dv[d] = 0.0f; }
    // t descends from T-1 for every work-item: neighbouring key rows read the same q, dout row together
    for (int t = T - 1; t >= t2; t--) {
        const float ds = datt[(bh * T + t) * T + t2];
        const float p = att[(bh * T + t) * T + t2];
        __global const float* q = qkv + (b * T + t) * C3 + h * D;
        __global const float* dy = dout + (b * T + t) * C + h * D;
        for (int d = 0; d < DV; d++) { dk[d] += ds * LDW(q, d); dv[d] += p * LDW(dy, d); }
    }
    __global float* o = dqkv + (b * T + t2) * C3 + h * D;
    for (int d = 0; d < DV; d++) { STW(o + C, d, dk[d] * SCALE); STW(o + 2 * C, d, dv[d]); }
}

// ---- GPUs: attention as batched matmuls (kernels/matmul.cl, BATCH=1, CAUSAL) plus these two row kernels ----
// One work-group of LW work-items per row r of att (B*H*T rows of T; query t = r % T), fixed-order tree
// reductions: deterministic.
//   attention_softmax:  att[r, t2] = softmax_{t2 <= t}(att[r, :])  (att holds SCALE * q.k), 0 for t2 > t
//   attention_dsoftmax: datt[r, t2] = att * (dp - sum_t2 att * dp)  (datt holds dp = dout . v), 0 for t2 > t
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void attention_softmax(const int T, __global float* att)
{
    const int r = get_group_id(0), l = get_local_id(0), t = r % T;
    __global float* row = att + (size_t)r * T;
    __local float red[LW];
    float mx = -INFINITY;
    for (int j = l; j <= t; j += LW) mx = fmax(mx, row[j]);
    mx = wg_reduce(red, mx, 1);
    float s = 0.0f;
    for (int j = l; j <= t; j += LW) {
        const float e = exp(row[j] - mx);
        row[j] = e;
        s += e;
    }
    const float inv = 1.0f / wg_reduce(red, s, 0);
    for (int j = l; j < T; j += LW) row[j] = j <= t ? row[j] * inv : 0.0f;
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void attention_dsoftmax(const int T, __global const float* att, __global float* datt)
{
    const int r = get_group_id(0), l = get_local_id(0), t = r % T;
    __global const float* arow = att + (size_t)r * T;
    __global float* drow = datt + (size_t)r * T;
    __local float red[LW];
    float s = 0.0f;
    for (int j = l; j <= t; j += LW) s += arow[j] * drow[j];
    s = wg_reduce(red, s, 0);
    for (int j = l; j < T; j += LW) drow[j] = j <= t ? arow[j] * (drow[j] - s) : 0.0f;
}

// Causal multi-head self-attention.  -D: C, H, D (= C/H), SCALE (= 1/sqrt(D))
// qkv (B,T,3C): q | k | v, head h at columns h*D..(h+1)*D-1 of each; out (B,T,C); att (B,H,T,T).
//   forward:  att[b,h,t,:] = softmax_{t2<=t}(SCALE * q_t . k_t2),  out[b,t,h] = sum_t2 att * v_t2
//   backward: dp = dout_t . v_t2;  ds = att * (dp - sum_t2 att * dp)  (kept in datt)
//             dq_t = SCALE sum_t2 ds k_t2;  dk_t2 = SCALE sum_t ds q_t;  dv_t2 = sum_t att dout_t
// One work-item per (query t | key t2, b*H+h), every sum in a fixed order: deterministic, no atomics.
#ifndef C
#error "C must be defined"
#endif
#define C3 (3 * C)

__kernel void attention_forward(const int B, const int T, __global const float* qkv,
                                __global float* out, __global float* att)
{
    const int t = get_global_id(0), bh = get_global_id(1);
    if (t >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    __global const float* q = qkv + (b * T + t) * C3 + h * D;
    __global float* arow = att + (bh * T + t) * T;
    float qv[D];
    for (int d = 0; d < D; d++) qv[d] = q[d];
    float mx = -INFINITY;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        float s = 0.0f;
        for (int d = 0; d < D; d++) s += qv[d] * k[d];
        s *= SCALE;
        arow[t2] = s;
        mx = fmax(mx, s);
    }
    float sum = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float e = exp(arow[t2] - mx);
        arow[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
    float acc[D];
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float p = arow[t2] * inv;
        arow[t2] = p;
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        for (int d = 0; d < D; d++) acc[d] += p * v[d];
    }
    for (int t2 = t + 1; t2 < T; t2++) arow[t2] = 0.0f;
    __global float* o = out + (b * T + t) * C + h * D;
    for (int d = 0; d < D; d++) o[d] = acc[d];
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
    float dy[D];
    for (int d = 0; d < D; d++) dy[d] = dout[(b * T + t) * C + h * D + d];
    float sdot = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        __global const float* v = qkv + (b * T + t2) * C3 + 2 * C + h * D;
        float dp = 0.0f;
        for (int d = 0; d < D; d++) dp += dy[d] * v[d];
        drow[t2] = dp;
        sdot += arow[t2] * dp;
    }
    float dq[D];
    for (int d = 0; d < D; d++) dq[d] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) {
        const float ds = arow[t2] * (drow[t2] - sdot);
        drow[t2] = ds;
        __global const float* k = qkv + (b * T + t2) * C3 + C + h * D;
        for (int d = 0; d < D; d++) dq[d] += ds * k[d];
    }
    __global float* o = dqkv + (b * T + t) * C3 + h * D;
    for (int d = 0; d < D; d++) o[d] = dq[d] * SCALE;
}

// Per key row t2: dk, dv into dqkv (overwrites the k and v parts). Reads ds from datt.
__kernel void attention_backward_key(const int B, const int T, __global const float* dout,
                                     __global const float* qkv, __global const float* att,
                                     __global const float* datt, __global float* dqkv)
{
    const int t2 = get_global_id(0), bh = get_global_id(1);
    if (t2 >= T || bh >= B * H) return;
    const int b = bh / H, h = bh % H;
    float dk[D], dv[D];
    for (int d = 0; d < D; d++) { dk[d] = 0.0f; dv[d] = 0.0f; }
    for (int t = t2; t < T; t++) {
        const float ds = datt[(bh * T + t) * T + t2];
        const float p = att[(bh * T + t) * T + t2];
        __global const float* q = qkv + (b * T + t) * C3 + h * D;
        __global const float* dy = dout + (b * T + t) * C + h * D;
        for (int d = 0; d < D; d++) { dk[d] += ds * q[d]; dv[d] += p * dy[d]; }
    }
    __global float* o = dqkv + (b * T + t2) * C3 + h * D;
    for (int d = 0; d < D; d++) { o[C + d] = dk[d] * SCALE; o[2 * C + d] = dv[d]; }
}

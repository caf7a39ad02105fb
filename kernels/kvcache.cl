// Decoding with a key/value cache: one new position per sequence and step, attending over the cache.
// -D: C (= H*D), D (head dim), CKV (= H_kv*D), G (= H / H_kv), TMAX (cache rows a sequence), SCALE (= 1/sqrt(D)),
//     ROPE (1: llama, rotate adjacent pairs of q and k; 0: gpt2), POS_EMBD (1: gpt2, add the position table's row)
// Shapes: B sequences, one row each; pos (B) int: the position of this step's token; caches kc, vc (B, TMAX, C)
// hold keys and values with each kv head repeated for its G query heads, as kernels/attention.cl reads them
// from qkv (the prefill copies its qkv rows there).
//   embed_at:   x[b] = wte[tokens[b]] (+ wpe[pos[b]])
//   kv_append:  q[b] = rope(src_q[b]);  kc[b, pos[b], h] = rope(src_k[b, h/G]);  vc[b, pos[b], h] = src_v[b, h/G]
//               src (B, C + 2 CKV): the q | k | v product's row; rope at angle pos[b] theta_i (cosb, sinb (T, D/2))
//   attention_decode: out[b, h] = sum_{t <= pos[b]} softmax_t(SCALE q[b,h] . kc[b,t,h]) vc[b,t,h]
// Each sum runs in the order kernels/attention.cl's does (d, then t ascending).
#ifndef C
#error "C must be defined"
#endif
#define H (C / D)
#define SW (C + 2 * CKV)  // src row width
#define HALF (D / 2)

// 2-D launch (C, B)
__kernel void embed_at(const int B, __global const int* tokens, __global const int* pos,
                       __global const float* wte, __global const float* wpe, __global float* x)
{
    const int c = get_global_id(0), b = get_global_id(1);
    if (c >= C || b >= B) return;
#if POS_EMBD
    x[b * C + c] = wte[tokens[b] * C + c] + wpe[pos[b] * C + c];
#else
    x[b * C + c] = wte[tokens[b] * C + c];
#endif
}

inline void rotate_or_copy(__global const float* s, __global float* o, __global const float* cs,
                           __global const float* sn)
{
#if ROPE
    for (int i = 0; i < HALF; i++) {
        const float c = cs[i], si = sn[i];
        const float a = s[2 * i], b = s[2 * i + 1];
        o[2 * i] = a * c - b * si;
        o[2 * i + 1] = a * si + b * c;
    }
#else
    for (int i = 0; i < D; i++) o[i] = s[i];
#endif
}

// 2-D launch (3H, B): slot h < H writes q head h, H <= h < 2H key head h-H, 2H <= h value head h-2H.
__kernel void kv_append(const int B, __global const float* src, __global const int* pos,
                        __global const float* cosb, __global const float* sinb, __global float* q,
                        __global float* kc, __global float* vc)
{
    const int slot = get_global_id(0), b = get_global_id(1);
    if (slot >= 3 * H || b >= B) return;
    const int t = pos[b], h = slot % H;
    __global const float* cs = cosb + t * HALF;
    __global const float* sn = sinb + t * HALF;
    __global const float* row = src + b * SW;
    if (slot < H) {
        rotate_or_copy(row + h * D, q + b * C + h * D, cs, sn);
    } else if (slot < 2 * H) {
        rotate_or_copy(row + C + (h / G) * D, kc + ((long)b * TMAX + t) * C + h * D, cs, sn);
    } else {
        __global const float* v = row + C + CKV + (h / G) * D;
        __global float* o = vc + ((long)b * TMAX + t) * C + h * D;
        for (int i = 0; i < D; i++) o[i] = v[i];
    }
}

// 2-D launch (H, B): one work-item a (sequence, head); its scores in private memory (TMAX floats).
__kernel void attention_decode(const int B, __global const float* q, __global const float* kc,
                               __global const float* vc, __global const int* pos, __global float* out)
{
    const int h = get_global_id(0), b = get_global_id(1);
    if (h >= H || b >= B) return;
    const int T = pos[b] + 1;
    __global const float* qh = q + b * C + h * D;
    __global const float* kb = kc + (long)b * TMAX * C + h * D;
    __global const float* vb = vc + (long)b * TMAX * C + h * D;
    float qv[D], sc[TMAX];
    for (int d = 0; d < D; d++) qv[d] = qh[d];
    float mx = -INFINITY;
    for (int t = 0; t < T; t++) {
        float s = 0.0f;
        for (int d = 0; d < D; d++) s += qv[d] * kb[t * C + d];
        sc[t] = s * SCALE;
        mx = fmax(mx, sc[t]);
    }
    float sum = 0.0f;
    for (int t = 0; t < T; t++) {
        sc[t] = exp(sc[t] - mx);
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
    float acc[D];
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int t = 0; t < T; t++) {
        const float p = sc[t] * inv;
        for (int d = 0; d < D; d++) acc[d] += p * vb[t * C + d];
    }
    for (int d = 0; d < D; d++) out[b * C + h * D + d] = acc[d];
}

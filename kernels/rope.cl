// Rotary position embedding (llama.cpp's "normal" rope: adjacent pairs (2i, 2i+1) of each head) fused
// with the packing of q, k, v into the qkv layout kernels/attention.cl reads, repeating the kv heads.
// -D: C (= H*D), D (head dim, even), G (= H / H_kv query heads per kv head), CKV (= H_kv*D)
// q (N,C), k (N,CKV), v (N,CKV) with rows n = b*T + t; cosb, sinb (T_max, D/2): cos/sin(t * theta_i),
// theta_i = base^(-2i/D), computed on the host in float64; qkv (N,3C): q | k | v, head h at h*D.
//   forward:  qkv_q[h,2i]   = q[h,2i] c - q[h,2i+1] s;   qkv_q[h,2i+1] = q[h,2i] s + q[h,2i+1] c
//             qkv_k[h] = rope(k[h/G]);  qkv_v[h] = v[h/G]
//   backward: the transposed rotation (angle -t theta_i); dk[j], dv[j] sum heads j*G..j*G+G-1 in order.
#ifndef C
#error "C must be defined"
#endif
#define HALF (D / 2)

__kernel void rope_qkv_forward(const int N, const int T, __global const float* q, __global const float* k,
                               __global const float* v, __global const float* cosb,
                               __global const float* sinb, __global float* qkv)
{
    const int j = get_global_id(0), n = get_global_id(1);  // j: one pair of the 3C/2 pairs of a row
    if (j >= 3 * (C / 2) || n >= N) return;
    const int part = j / (C / 2), p = j % (C / 2);
    const int h = p / HALF, i = p % HALF;
    const int t = n % T;
    const float c = cosb[t * HALF + i], s = sinb[t * HALF + i];
    __global float* o = qkv + n * 3 * C + part * C + h * D + 2 * i;
    if (part == 0) {
        __global const float* src = q + n * C + h * D + 2 * i;
        o[0] = src[0] * c - src[1] * s;
        o[1] = src[0] * s + src[1] * c;
    } else if (part == 1) {
        __global const float* src = k + n * CKV + (h / G) * D + 2 * i;
        o[0] = src[0] * c - src[1] * s;
        o[1] = src[0] * s + src[1] * c;
    } else {
        __global const float* src = v + n * CKV + (h / G) * D + 2 * i;
        o[0] = src[0];
        o[1] = src[1];
    }
}

__kernel void rope_qkv_backward(const int N, const int T, __global const float* dqkv,
                                __global const float* cosb, __global const float* sinb,
                                __global float* dq, __global float* dk, __global float* dv)
{
    const int j = get_global_id(0), n = get_global_id(1);  // j: C/2 pairs of dq, then CKV/2 of dk, CKV/2 of dv
    if (j >= C / 2 + CKV || n >= N) return;
    const int t = n % T;
    __global const float* row = dqkv + n * 3 * C;
    if (j < C / 2) {
        const int h = j / HALF, i = j % HALF;
        const float c = cosb[t * HALF + i], s = sinb[t * HALF + i];
        __global const float* d = row + h * D + 2 * i;
        dq[n * C + h * D + 2 * i] = d[0] * c + d[1] * s;
        dq[n * C + h * D + 2 * i + 1] = -d[0] * s + d[1] * c;
        return;
    }
    const int jj = j - C / 2;
    const int is_v = jj >= CKV / 2;
    const int p = is_v ? jj - CKV / 2 : jj;
    const int kvh = p / HALF, i = p % HALF;
    float a = 0.0f, b = 0.0f;
    for (int g = 0; g < G; g++) {
        __global const float* d = row + (is_v ? 2 * C : C) + (kvh * G + g) * D + 2 * i;
        a += d[0];
        b += d[1];
    }
    if (is_v) {
        dv[n * CKV + kvh * D + 2 * i] = a;
        dv[n * CKV + kvh * D + 2 * i + 1] = b;
    } else {
        const float c = cosb[t * HALF + i], s = sinb[t * HALF + i];
        dk[n * CKV + kvh * D + 2 * i] = a * c + b * s;
        dk[n * CKV + kvh * D + 2 * i + 1] = -a * s + b * c;
    }
}

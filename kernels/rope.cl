// Rotary position embedding (llama.cpp's "normal" rope: adjacent pairs (2i, 2i+1) of each head) on the
// output of the one q | k | v product, into the qkv layout kernels/attention.cl reads (kv heads repeated).
// -D: C (= H*D), D (head dim, even), G (= H / H_kv query heads per kv head), CKV (= H_kv*D)
// src (N, C + 2 CKV): q | k | v rows n = b*T + t (the product's output); cosb, sinb (T_max, D/2):
// cos/sin(t * theta_i), theta_i = base^(-2i/D), computed on the host in float64; qkv (N,3C): q | k | v,
// head h at h*D.  With G == 1 the two layouts are one: the kernels run in place (src == qkv) and leave v.
//   forward:  qkv_q[h,2i]   = q[h,2i] c - q[h,2i+1] s;   qkv_q[h,2i+1] = q[h,2i] s + q[h,2i+1] c
//             qkv_k[h] = rope(k[h/G]);  qkv_v[h] = v[h/G]
//   backward: dsrc from dqkv: the transposed rotation (angle -t theta_i); dk[j], dv[j] sum heads
//             j*G..j*G+G-1 in order.
// One work-item per (row, head slot), D/2 pairs in a loop: few work-groups (PoCL's cost per group).
#ifndef C
#error "C must be defined"
#endif
#include "rope_pair.cl"
#define HALF (D / 2)

#define H (C / D)
#define SW (C + 2 * CKV)  // src row width
#if G == 1
#define FWD_SLOTS (2 * H)  // in place: q and k heads; v already where attention reads it
#define BWD_SLOTS (2 * H)
#else
#define FWD_SLOTS (3 * H)
#define BWD_SLOTS (H + 2 * (CKV / D))
#endif

#if defined(ROPE_VEC) && D % 8 == 0
// CPUs (-DROPE_VEC=1): 4 pairs at a time, split into even (a) and odd (b) lanes and interleaved back; the same
// operations pair by pair as the loop below, so the same bits.
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
typedef float float4u __attribute__((ext_vector_type(4), aligned(4)));
inline void rope_rotate(__global const float* s, __global float* o, __global const float* cs,
                        __global const float* sn, const float sign)
{
    for (int i = 0; i < HALF; i += 4) {
        const float4 c = *(__global const float4u*)(cs + i), si = sign * *(__global const float4u*)(sn + i);
        const float8 v = *(__global const float8u*)(s + 2 * i);
        const float4 a = v.even, b = v.odd;
        const float4 x = a * c - b * si, y = a * si + b * c;
        *(__global float8u*)(o + 2 * i) = __builtin_shufflevector(x, y, 0, 4, 1, 5, 2, 6, 3, 7);
    }
}
#else
inline void rope_rotate(__global const float* s, __global float* o, __global const float* cs,
                        __global const float* sn, const float sign)
{
    for (int i = 0; i < HALF; i++) {
        const float c = cs[i], si = sign * sn[i];
        const float a = s[2 * i], b = s[2 * i + 1];
        o[2 * i] = a * c - b * si;
        o[2 * i + 1] = a * si + b * c;
    }
}
#endif

// 2-D launch (FWD_SLOTS, N): slot h < H rotates q head h, H <= h < 2H k head (h-H)/G, 2H <= h copies v.
__kernel void rope_forward(const int N, const int T, __global const float* src, __global const float* cosb,
                           __global const float* sinb, __global float* qkv)
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= FWD_SLOTS || n >= N) return;
    const int t = n % T;
    __global const float* row = src + (size_t)n * SW;
    __global float* o = qkv + (size_t)n * 3 * C + h * D;  // q head h at h*D, k head at C + .., v at 2C + ..
    if (h < H) {
        rope_rotate(row + h * D, o, cosb + t * HALF, sinb + t * HALF, 1.0f);
    } else if (h < 2 * H) {
        rope_rotate(row + C + ((h - H) / G) * D, o, cosb + t * HALF, sinb + t * HALF, 1.0f);
    } else {
        __global const float* s = row + C + CKV + ((h - 2 * H) / G) * D;
        for (int i = 0; i < D; i++) o[i] = s[i];
    }
}

// 2-D launch (BWD_SLOTS, N): slot h < H q head h; then H_kv k heads, then (G > 1) H_kv v heads.
// dsrc may be dqkv when G == 1 (in place; dv is dqkv's v part as it stands).
__kernel void rope_backward(const int N, const int T, __global const float* dqkv, __global const float* cosb,
                            __global const float* sinb, __global float* dsrc)
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= BWD_SLOTS || n >= N) return;
    const int t = n % T;
    __global const float* row = dqkv + (size_t)n * 3 * C;
    __global float* o = dsrc + (size_t)n * SW;
    if (h < H) {
        rope_rotate(row + h * D, o + h * D, cosb + t * HALF, sinb + t * HALF, -1.0f);
        return;
    }
#if G == 1
    rope_rotate(row + h * D, o + h * D, cosb + t * HALF, sinb + t * HALF, -1.0f);  // k head h - H, at C + ..
#else
    const int hkv = CKV / D, j = h - H;
    const int is_v = j >= hkv, kvh = is_v ? j - hkv : j;
    __global const float* d = row + (is_v ? 2 * C : C) + kvh * G * D;
    __global float* out = o + C + (is_v ? CKV : 0) + kvh * D;
    __global const float* cs = cosb + t * HALF;
    __global const float* sn = sinb + t * HALF;
    for (int i = 0; i < HALF; i++) {
        float a = 0.0f, b = 0.0f;
        for (int g = 0; g < G; g++) {
            a += d[g * D + 2 * i];
            b += d[g * D + 2 * i + 1];
        }
        if (is_v) {
            out[2 * i] = a;
            out[2 * i + 1] = b;
        } else {
            out[2 * i] = a * cs[i] + b * sn[i];
            out[2 * i + 1] = -a * sn[i] + b * cs[i];
        }
    }
#endif
}

// GPUs: one work-item per pair (2-D launch (slots * D/2, N)), so neighbouring work-items read and write
// neighbouring pairs; the loops above, one work-item a head, read D floats apart and left the memory system
// mostly idle. The same operations pair by pair as rope_rotate's loop, so the same bits.
__kernel void rope_forward_el(const int N, const int T, __global const float* src, __global const float* cosb,
                              __global const float* sinb, __global float* qkv)
{
    const int p = get_global_id(0), n = get_global_id(1);
    if (p >= FWD_SLOTS * HALF || n >= N) return;
    const int h = p / HALF, i = p % HALF, t = n % T;
    __global const float* row = src + (size_t)n * SW;
    __global float* o = qkv + (size_t)n * 3 * C + h * D + 2 * i;
    if (h < 2 * H) {
        __global const float* s = row + (h < H ? h * D : C + ((h - H) / G) * D) + 2 * i;
        // rope_rotate's operations (sign * sn, sign 1), in the one expression flash.cl's fused copy uses
        vstore2(rope_pair(s[0], s[1], cosb[t * HALF + i], sinb[t * HALF + i]), 0, o);
    } else {
        __global const float* s = row + C + CKV + ((h - 2 * H) / G) * D + 2 * i;
        o[0] = s[0];
        o[1] = s[1];
    }
}

__kernel void rope_backward_el(const int N, const int T, __global const float* dqkv, __global const float* cosb,
                               __global const float* sinb, __global float* dsrc)
{
    const int p = get_global_id(0), n = get_global_id(1);
    if (p >= BWD_SLOTS * HALF || n >= N) return;
    const int h = p / HALF, i = p % HALF, t = n % T;
    __global const float* row = dqkv + (size_t)n * 3 * C;
    __global float* o = dsrc + (size_t)n * SW;
    const float c = cosb[t * HALF + i], sn = sinb[t * HALF + i];
    if (G == 1 || h < H) {  // q heads, and with G == 1 k heads in place (flash.cl's ROPE stores: the same)
        vstore2(rope_pair(row[h * D + 2 * i], row[h * D + 2 * i + 1], c, -sn), 0, o + h * D + 2 * i);
        return;
    }
#if G != 1  // k and v heads: each sums its G query heads' gradients
    const int hkv = CKV / D, j = h - H;
    const int is_v = j >= hkv, kvh = is_v ? j - hkv : j;
    __global const float* d = row + (is_v ? 2 * C : C) + kvh * G * D + 2 * i;
    float a = 0.0f, b = 0.0f;
    for (int g = 0; g < G; g++) {
        a += d[g * D];
        b += d[g * D + 1];
    }
    __global float* out = o + C + (is_v ? CKV : 0) + kvh * D + 2 * i;
    if (is_v) {
        out[0] = a;
        out[1] = b;
    } else {
        out[0] = a * c + b * sn;
        out[1] = -a * sn + b * c;
    }
#endif
}

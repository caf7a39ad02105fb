// Fused softmax + cross-entropy with a per-token loss mask.  -D: V; LS (optional, 0 < LS < 1: label smoothing)
// logits (N,V), targets (N) int, mask (N).
//   forward:  lse[n] = log sum_v exp(logits[n,v]);  losses[n] = mask[n] * (lse[n] - logits[n,target])
//             (the host sums losses in order and divides by sum(mask))
//   backward: dlogits[n,v] = s * mask[n] * (exp(logits[n,v] - lse[n]) - [v == target]),  s = scale / sum(mask)
// With LS the target is (1 - LS) onehot + LS / V, as torch's cross_entropy(label_smoothing=LS):
//   forward:  losses[n] = mask[n] * ((1 - LS) (lse[n] - logits[n,target]) + LS (lse[n] - sum_v logits[n,v] / V))
//   backward: dlogits[n,v] = s * mask[n] * (exp(logits[n,v] - lse[n]) - (1 - LS) [v == target] - LS / V)
// Without LS every kernel compiles to what it was before label smoothing existed (the #ifdef LS blocks vanish).
#ifndef V
#error "V must be defined"
#endif
// LOGITS_BF16 1 (xent_forward_wg, xent_backward_tiled): the logits are bf16, row-major (the head's product wrote
// them so, matmul_wgmma.cl OUT_BF16: the loss is their only reader), read as the floats they hold; the sums after
// the loads are as with fp32 logits.
#ifndef LOGITS_BF16
#define LOGITS_BF16 0
#endif
#if LOGITS_BF16
typedef ushort logit_t;
#define LOGIT(p, i) as_float((uint)(p)[i] << 16)
#define LOGIT4(p, i) as_float4(convert_uint4(vload4(0, (p) + (i))) << 16)
#else
typedef float logit_t;
#define LOGIT(p, i) (p)[i]
#define LOGIT4(p, i) vload4(0, (p) + (i))
#endif

// a live row's loss from its lse z, its target's logit lt and the sum of its logits sl (without LS unparenthesised:
// that build is the source as it was, token for token)
#ifdef LS
#define XENT_LOSS(z, lt, sl) ((1.0f - LS) * ((z) - (lt)) + LS * ((z) - (sl) / V))
#else
#define XENT_LOSS(z, lt, sl) (z - lt)
#endif

__kernel void xent_forward(const int N, __global const float* logits, __global const int* targets,
                           __global const float* mask, __global float* losses, __global float* lse)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* l = logits + (size_t)n * V;
    float mx = -INFINITY;
#ifdef LS
    float sl = 0.0f;
    for (int v = 0; v < V; v++) {
        mx = fmax(mx, l[v]);
        sl += l[v];
    }
#else
    for (int v = 0; v < V; v++) mx = fmax(mx, l[v]);
#endif
    float s = 0.0f;
    for (int v = 0; v < V; v++) s += exp(l[v] - mx);
    const float z = mx + log(s);
    lse[n] = z;
    const int tgt = targets[n];
    const float mk = mask[n];
    losses[n] = (mk != 0.0f && tgt >= 0 && tgt < V) ? mk * XENT_LOSS(z, l[tgt], sl) : 0.0f;
}

// one gradient element: sm = s * mask[n], z = lse[n], hit: v is the target
inline float xent_grad(const float l, const float z, const float sm, const int hit)
{
#ifdef LS
    return sm * (exp(l - z) - (hit ? 1.0f - LS + LS / V : LS / V));
#else
    return sm * (exp(l - z) - (hit ? 1.0f : 0.0f));
#endif
}

__kernel void xent_backward(const int N, const float s, __global const float* logits,
                            __global const int* targets, __global const float* mask,
                            __global const float* lse, __global float* dlogits)
{
    const int v = get_global_id(0), n = get_global_id(1);
    if (v >= V || n >= N) return;
    const size_t i = (size_t)n * V + v;
    dlogits[i] = xent_grad(logits[i], lse[n], s * mask[n], v == targets[n]);
}

// xent_backward_tiled: the same gradient straight into the bf16 copy kernels/matmul_wgmma.cl reads (precision.cl
// tiled_chunk; the fp32 dlogits is not written), zeros outside N x V; 8 v a work-item, global (Vp/8, Np).
#include "precision.cl"
__kernel void xent_backward_tiled(const int N, const float s, __global const logit_t* logits,
                                  __global const int* targets, __global const float* mask,
                                  __global const float* lse, __global uint4* O)
{
    const int c = get_global_id(0), n = get_global_id(1), v0 = 8 * c;
    float d[8];
    if (n < N) {
        const float z = lse[n], sm = s * mask[n];
        const int tgt = targets[n];
        __global const logit_t* l = logits + (size_t)n * V;
#if LOGITS_BF16 && V % 8 == 0  // the 8 halves in one 16-byte load
        float lv[8];
        if (v0 < V) vstore8(as_float8(convert_uint8(vload8(0, l + v0)) << 16), 0, lv);
#pragma unroll
        for (int h = 0; h < 8; h++) d[h] = v0 + h < V ? xent_grad(lv[h], z, sm, v0 + h == tgt) : 0.0f;
#else
#pragma unroll
        for (int h = 0; h < 8; h++)
            d[h] = v0 + h < V ? xent_grad(LOGIT(l, v0 + h), z, sm, v0 + h == tgt) : 0.0f;
#endif
    } else {
#pragma unroll
        for (int h = 0; h < 8; h++) d[h] = 0.0f;
    }
    O[tiled_chunk(n, v0, get_global_size(1))] = bf16x8(d);
}

// GPUs: one work-group of LW work-items per row, fixed-order tree reductions (deterministic). One pass over the
// row (a second pass read it again: 1.6 GB a step at GPT-2's vocabulary and 8192 rows): each work-item keeps a
// running max m of its logits and the sum of exp(x - m), rescaled when m grows (float4 at a time where V % 4 ==
// 0); then the group's max M and the sum of each item's s * exp(m - M). With LS each work-item also sums its logits,
// and a third reduction adds those.
#include "reduce.cl"

__kernel __attribute__((reqd_work_group_size(LW, 1, 1))) SG_KERNEL
void xent_forward_wg(const int N, __global const logit_t* logits, __global const int* targets,
                     __global const float* mask, __global float* losses, __global float* lse)
{
    const int n = get_group_id(0), l = get_local_id(0);
    __local float red[LW];
    __global const logit_t* lg = logits + (size_t)n * V;
    float m = -INFINITY, s = 0.0f;
#ifdef LS
    float sl = 0.0f;
#endif
#if V % 4 == 0
    for (int v = 4 * l; v < V; v += 4 * LW) {
        const float4 x = LOGIT4(lg, v);
#ifdef LS
        sl += (x.x + x.y) + (x.z + x.w);
#endif
        const float mx = fmax(fmax(x.x, x.y), fmax(x.z, x.w));
        if (mx > m) {
            s *= exp(m - mx);
            m = mx;
        }
        s += (exp(x.x - m) + exp(x.y - m)) + (exp(x.z - m) + exp(x.w - m));
    }
#else
    for (int v = l; v < V; v += LW) {
        const float x = LOGIT(lg, v);
#ifdef LS
        sl += x;
#endif
        if (x > m) {
            s *= exp(m - x);
            m = x;
        }
        s += exp(x - m);
    }
#endif
    const float mx = wg_reduce(red, m, 1);
    s = wg_reduce(red, m == -INFINITY ? 0.0f : s * exp(m - mx), 0);
#ifdef LS
    sl = wg_reduce(red, sl, 0);
#endif
    if (l == 0) {
        const float z = mx + log(s);
        lse[n] = z;
        const int tgt = targets[n];
        const float mk = mask[n];
        losses[n] = (mk != 0.0f && tgt >= 0 && tgt < V) ? mk * XENT_LOSS(z, LOGIT(lg, tgt), sl) : 0.0f;
    }
}

// CPUs: one work-item per row, the row handled as float8 vectors (PoCL's vector exp is a vectorised
// polynomial, ~1 ns a logit against ~7 for the per-element kernels above; float8 is the AVX2 width PoCL
// targets here, float16 crashed its compiler; native_exp measured no faster). Forward and the gradient in one kernel: the exps go into
// dlogits on the second pass over the row (in cache) and are scaled in place on the third, so each logit
// costs one exp. dlogits gets the UNSCALED gradient mask[n] * (softmax - onehot(target)); the host folds
// scale / sum(mask) into the alpha of the two matmuls that read it (with LS: mask[n] * (softmax - (1 - LS) onehot -
// LS / V), the row's logits summed on the max pass). Lanes sum in a fixed order.
#define XW 8
typedef float floatx __attribute__((ext_vector_type(XW), aligned(4)));
#define LDX(p) (*(__global const floatx*)(p))
#define STX(p, x) (*(__global floatx*)(p) = (x))
inline float xhsum(const floatx v)
{
    const float4 b = v.lo + v.hi;
    const float2 c = b.lo + b.hi;
    return c.x + c.y;
}
inline float xhmax(const floatx v)
{
    const float4 b = fmax(v.lo, v.hi);
    const float2 c = fmax(b.lo, b.hi);
    return fmax(c.x, c.y);
}
#ifndef XEXP
#define XEXP exp
#endif

__kernel void xent_fused(const int N, __global const float* logits, __global const int* targets,
                         __global const float* mask, __global float* losses, __global float* lse,
                         __global float* dlogits)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* l = logits + (size_t)n * V;
    __global float* d = dlogits + (size_t)n * V;
    const int VX = V / XW * XW;
    floatx mv = -INFINITY;
#ifdef LS
    floatx slv = 0.0f;
    for (int v = 0; v < VX; v += XW) {
        const floatx x = LDX(l + v);
        mv = fmax(mv, x);
        slv += x;
    }
    float sl = xhsum(slv);
    for (int v = VX; v < V; v++) sl += l[v];
#else
    for (int v = 0; v < VX; v += XW) mv = fmax(mv, LDX(l + v));
#endif
    float mx = xhmax(mv);
    for (int v = VX; v < V; v++) mx = fmax(mx, l[v]);
    floatx sv = 0.0f;
    for (int v = 0; v < VX; v += XW) {
        const floatx e = XEXP(LDX(l + v) - mx);
        STX(d + v, e);
        sv += e;
    }
    float s = xhsum(sv);
    for (int v = VX; v < V; v++) {
        const float e = XEXP(l[v] - mx);
        d[v] = e;
        s += e;
    }
    const float z = mx + log(s);
    lse[n] = z;
    const int tgt = targets[n];
    const float mk = mask[n];
    const int live = mk != 0.0f && tgt >= 0 && tgt < V;
    losses[n] = live ? mk * XENT_LOSS(z, l[tgt], sl) : 0.0f;
    const float r = mk / s;
#ifdef LS
    const float c = mk * (LS / V);
    for (int v = 0; v < VX; v += XW) STX(d + v, LDX(d + v) * r - c);
    for (int v = VX; v < V; v++) d[v] = d[v] * r - c;
    if (live) d[tgt] -= mk * (1.0f - LS);
#else
    for (int v = 0; v < VX; v += XW) STX(d + v, LDX(d + v) * r);
    for (int v = VX; v < V; v++) d[v] *= r;
    if (live) d[tgt] -= mk;
#endif
}

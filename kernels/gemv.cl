// Matrix-vector products of a decode step: a few rows x (B, K) against a weight W (N, K) stored as the GGUF has
// it (out, in), so each output reads one contiguous row of W and no transposed copy is made per call.
// -D: K, BIAS (add bias (N)), RESID (add resid (B, N)), GELU (also write E (B, N) = gelu(y), tanh form as
//     kernels/gelu.cl; y keeps the pre-activation)
//   y[b, n] = sum_k x[b, k] W[n, k] (+ bias[n]) (+ resid[b, n])
// One work-item a (n, b): eight k at a time as float8 partial sums, then their sum, then the tail k.
#ifndef K
#error "K must be defined"
#endif
#define GELU_S 0.7978845608028654f

__kernel void gemv_nt(const int B, const int N, __global const float* x, __global const float* W,
                      __global const float* bias, __global const float* resid, __global float* y,
                      __global float* E)
{
    const int n = get_global_id(0), b = get_global_id(1);
    if (n >= N || b >= B) return;
    __global const float* xr = x + (long)b * K;
    __global const float* w = W + (long)n * K;
    float8 acc = 0.0f;
    int k = 0;
    for (; k + 8 <= K; k += 8) acc += vload8(0, xr + k) * vload8(0, w + k);
    const float4 h4 = acc.lo + acc.hi;
    const float2 h2 = h4.lo + h4.hi;
    float s = h2.x + h2.y;
    for (; k < K; k++) s += xr[k] * w[k];
#if BIAS
    s += bias[n];
#endif
#if RESID
    s += resid[(long)b * N + n];
#endif
    y[(long)b * N + n] = s;
#if GELU
    const float u = GELU_S * (s + 0.044715f * s * s * s);
    E[(long)b * N + n] = s - s / (exp(2.0f * u) + 1.0f);
#endif
}

// gemv_pairs: a decode step's product with its neighbours folded in, so that a llama block is five launches,
// not nine. Each work-group first takes row b of x (B, K) into local memory, normalised when NORM is 1 (RMSNorm
// with weight nw, eps EPS; K floats, cheaper than a launch of its own); with EMBED it reads that row from the
// token table instead (wte[tokens[b]]) and work-group 0 also stores it in x, the block's residual. Each
// work-item then makes two outputs, sharing the row's loads:
//   EPI 0: y[b, n], y[b, n + 1] = rows n = 2p, n + 1 of W . xn (+ resid[b, .] with RESID)         y (B, N)
//   EPI 1: the q|k|v product (N = C + 2 CKV): q pairs RoPE'd into y (B, C); k pairs RoPE'd and v pairs into the
//          caches kc, vc (B, TMAX, C) at pos[b], each kv head repeated for its G query heads (as kernels/
//          kvcache.cl's kv_append); RoPE turns (2i, 2i+1) of a head by pos[b] theta_i (cosb, sinb (TMAX, D/2))
//   EPI 2: the gate|up product (W (2F, K), N = 2F): y[b, p] = silu(gate_p . xn) * (up_p . xn)       y (B, F)
// Sums as gemv_nt's, the norm's in a fixed order: deterministic.
// -D: K, NORM, EMBED, EPI, RESID, LW (work-group size), EPS; EPI 1 also C, D, CKV, G, TMAX
// 2-D launch (ceil(N / 2) padded to LW, B), local (LW, 1).
#ifndef EPS
#define EPS 1e-5f
#endif
#ifndef LW
#define LW 16
#endif

inline float dot_local(__local const float* x, __global const float* w)
{
    float8 acc = 0.0f;
    int k = 0;
    for (; k + 8 <= K; k += 8) acc += vload8(0, x + k) * vload8(0, w + k);
    const float4 h4 = acc.lo + acc.hi;
    const float2 h2 = h4.lo + h4.hi;
    float s = h2.x + h2.y;
    for (; k < K; k++) s += x[k] * w[k];
    return s;
}

__kernel __attribute__((reqd_work_group_size(LW, 1, 1)))
void gemv_pairs(const int B, const int N, __global float* x, __global const int* tokens,
                __global const float* wte, __global const float* nw, __global const float* W,
                __global const float* resid, __global float* y, __global const int* pos,
                __global const float* cosb, __global const float* sinb, __global float* kc, __global float* vc)
{
    __local float xn[K];
    __local float part[LW];
    const int p = get_global_id(0), b = get_global_id(1), lid = get_local_id(0);
#if EMBED
    __global const float* xr = wte + (long)tokens[b] * K;
#else
    __global const float* xr = x + (long)b * K;
#endif
    float ss = 0.0f;
    for (int k = lid; k < K; k += LW) {
        const float v = xr[k];
        xn[k] = v;
        ss += v * v;
#if EMBED
        if (get_group_id(0) == 0) x[(long)b * K + k] = v;
#endif
    }
#if NORM
    part[lid] = ss;
    barrier(CLK_LOCAL_MEM_FENCE);
    float tot = 0.0f;
    for (int i = 0; i < LW; i++) tot += part[i];
    const float r = 1.0f / sqrt(tot / K + EPS);
    for (int k = lid; k < K; k += LW) xn[k] = xn[k] * r * nw[k];
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    const int n = 2 * p;
    if (n >= N) return;
#if EPI == 2
    const int F = N / 2;
    const float g = dot_local(xn, W + (long)p * K), u = dot_local(xn, W + (long)(F + p) * K);
    y[(long)b * F + p] = g / (1.0f + exp(-g)) * u;
#elif EPI == 1
    float s0 = dot_local(xn, W + (long)n * K), s1 = dot_local(xn, W + (long)(n + 1) * K);
    const int t = pos[b], i = (n % D) / 2;
    if (n < C + CKV) {  // q or k: turn the pair
        const float c = cosb[t * (D / 2) + i], sn = sinb[t * (D / 2) + i], a = s0;
        s0 = a * c - s1 * sn;
        s1 = a * sn + s1 * c;
    }
    if (n < C) {
        y[(long)b * C + n] = s0;
        y[(long)b * C + n + 1] = s1;
    } else {
        const int kv = n < C + CKV ? n - C : n - C - CKV;  // the column within the kv heads
        __global float* row = (n < C + CKV ? kc : vc) + ((long)b * TMAX + t) * C;
        const int h = kv / D, d = kv % D;
        for (int j = 0; j < G; j++) {
            row[(h * G + j) * D + d] = s0;
            row[(h * G + j) * D + d + 1] = s1;
        }
    }
#else
    for (int o = n; o < n + 2 && o < N; o++) {
        float s = dot_local(xn, W + (long)o * K);
#if RESID
        s += resid[(long)b * N + o];
#endif
        y[(long)b * N + o] = s;
    }
#endif
}

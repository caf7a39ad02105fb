// Causal flash attention 2 (Dao 2023) in plain OpenCL C 1.2 for any GPU: local-memory tiles, fp32 math, no
// extension, no atomics. The T x T scores never reach memory; the backward recomputes them from the forward's
// log-sum-exp rows.
//   forward:      s = SCALE q.k (key <= query), out = softmax(s) v, lse = log2 sum_key exp2(s log2 e) (B*H*T)
//   backward dq:  delta = rowsum(dout * out) (B*H*T), p = exp2(s log2 e - lse), dp = dout.v,
//                 ds = p (dp - delta), dq = SCALE sum_key ds k
//   backward dkv: dv = sum_query p dout, dk = SCALE sum_query ds q (reads delta: runs after dq)
// qkv (B,T,3C), out and dout (B,T,C), dqkv (B,T,3C); head h's q, k, v at columns h*D, C + h*D, 2C + h*D.
// Dropout (p > 0) on the probabilities as dropout.cl with element index (z*T + query)*T + key, z = b*H + h: the
// mask the batched form (attention.cl's att of shape (B,H,T,T)) draws; the row sums use the probabilities before
// dropout, the products with v (and dp) the dropped ones, as the batched form's dsoftmax does.
// A work-group takes BR rows of one (batch, head): queries (forward, dq) or keys (dk/dv), each row NC work-items
// (BR * NC items: r = id % BR, c = id / BR). It walks the other side in steps of BC rows staged in local memory:
// the NC items of a row score BC / NC of the step's columns each into a local tile, then each reads the row's
// whole tile and keeps D / NC of its outputs (columns c D/NC ..). Staged rows are read as float4 where the head
// width allows (D % 4 == 0: one local read a 4 multiply-adds; the items of a warp share a row and column, so
// the reads broadcast). Work-groups start with the most causal work (the last query blocks, the first key blocks),
// so the launch does not end on a tail of long ones. Every sum runs in a fixed order: the same bytes on every run. Rows past T compute on
// clamped data and store nothing (any T).
// Local memory (floats): forward BC KP + BR (BC+1) + 2 NC BR; dq 2 BC KP + BR (BC+1); dk/dv 2 BC KP + 2 BR (BC+1) + 2 BC,
// KP = D + 4 (clgpt/device/tuner_flash.py local_bytes). Private: the row's q (k) and dout (v), D floats each.
// ROUND (precision.cl: 1 bf16, 2 tf32; 0 or absent fp32) rounds the products' operands as the batched form's GEMM
// does: q, k, v and dout as they are loaded, the (dropped) probabilities before the product with v (dout), ds
// before those with k and q; the softmax, its statistics, delta and every sum stay fp32.
// -D: C H D (any head width; NC divides D and BC), SCALE, BR BC NC, ROUND; global (ceil(T/BR) * BR * NC, B*H).
#include "precision.cl"
#include "dropout.cl"

#define C3 (3 * C)
#define NT (BR * NC)      // work-items a work-group
#define DS (D / NC)       // outputs a work-item keeps: columns c DS + e
#define CS (BC / NC)      // columns of a step a work-item scores
#define KP (D + 4)        // local row of a staged block (16-byte aligned; rows of a step 4 banks apart)
#define SP (BC + 1)       // local row of a score tile (odd: a warp's rows fall in distinct banks)
#define SL2 (SCALE * 1.4426950408889634f)

#if D % NC || BC % NC
#error "NC must divide D and BC"
#endif
#if ROUND == 1
#define RND(x) round_bf16(x)
#elif ROUND == 2
#define RND(x) round_tf32(x)
#else
#define RND(x) (x)
#endif

// rows r0.. r0+BC of one head's columns col of a (B,T,width) buffer into dst[BC][KP], zeros past T
inline void stage(__local float* dst, __global const float* src, const int width, const int col, const int r0,
                  const int T)
{
    for (int e = get_local_id(0); e < BC * D; e += NT) {
        const int j = e / D, d = e % D;
        dst[j * KP + d] = r0 + j < T ? RND(src[(size_t)(r0 + j) * width + col + d]) : 0.0f;
    }
}

// x . y in order of d, x private, y a staged row
inline float dot_local(const float* x, __local const float* y)
{
    float s = 0.0f;
#if D % 4 == 0
    for (int d = 0; d < D; d += 4) {
        const float4 v = vload4(0, y + d);
        s = fma(x[d], v.x, s);
        s = fma(x[d + 1], v.y, s);
        s = fma(x[d + 2], v.z, s);
        s = fma(x[d + 3], v.w, s);
    }
#else
    for (int d = 0; d < D; d++) s = fma(x[d], y[d], s);
#endif
    return s;
}

// acc[e] += a * y[e] for the DS columns a work-item keeps (y: its chunk of a staged row)
inline void axpy_local(float* acc, const float a, __local const float* y)
{
#if DS % 4 == 0
    for (int e = 0; e < DS; e += 4) {
        const float4 v = vload4(0, y + e);
        acc[e] = fma(a, v.x, acc[e]);
        acc[e + 1] = fma(a, v.y, acc[e + 1]);
        acc[e + 2] = fma(a, v.z, acc[e + 2]);
        acc[e + 3] = fma(a, v.w, acc[e + 3]);
    }
#else
    for (int e = 0; e < DS; e++) acc[e] = fma(a, y[e], acc[e]);
#endif
}

__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void flash_portable_forward(const int T, __global const float* restrict qkv, __global float* restrict out,
                            __global float* restrict lse, const uint seed, const uint site, const float p)
{
    __local float kv[BC * KP];
    __local float sc[BR * SP];
    __local float part[2 * NC * BR];  // by (c, r): an item's max of its scores of a step, then its sum of exps
    const int lid = get_local_id(0), r = lid % BR, c = lid / BR, z = get_global_id(1), b = z / H, h = z % H;
    const int q0 = (get_num_groups(0) - 1 - get_group_id(0)) * BR, qi = q0 + r;  // the longest rows first
    __global const float* x = qkv + (size_t)b * T * C3;
    float qv[D], acc[DS];
    for (int d = 0; d < D; d++) qv[d] = RND(x[(size_t)min(qi, T - 1) * C3 + h * D + d]) * SL2;  // log2 domain
    for (int e = 0; e < DS; e++) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;  // key 0 is causal for every row: m is finite after the first step
    const float keep_scale = 1.0f / (1.0f - p);
    const uint row = ((uint)z * T + (uint)qi) * (uint)T;  // dropout's element index of (query, key 0)
    const int kend = min(T, q0 + BR);
    for (int k0 = 0; k0 < kend; k0 += BC) {
        barrier(CLK_LOCAL_MEM_FENCE);
        stage(kv, x, C3, C + h * D, k0, T);
        barrier(CLK_LOCAL_MEM_FENCE);
        float mx = -INFINITY;
        for (int u = 0; u < CS; u++) {
            const int j = c + NC * u, key = k0 + j;
            const float sj = key <= qi && key < T ? dot_local(qv, kv + j * KP) : -INFINITY;
            sc[r * SP + j] = sj;
            mx = fmax(mx, sj);
        }
        part[c * BR + r] = mx;
        barrier(CLK_LOCAL_MEM_FENCE);
        stage(kv, x, C3, 2 * C + h * D, k0, T);  // v over k: the scores are in sc
        float mt = m;
        for (int i = 0; i < NC; i++) mt = fmax(mt, part[i * BR + r]);
        float ls = 0.0f;  // each item exponentiates (and drops) its own columns: the row's probabilities once
        for (int u = 0; u < CS; u++) {
            const int j = c + NC * u;
            float pj = exp2(sc[r * SP + j] - mt);
            ls += pj;
            if (p > 0.0f) pj = dropout_keep(seed, site, row + (uint)(k0 + j), p) ? pj * keep_scale : 0.0f;
            sc[r * SP + j] = RND(pj);
        }
        part[(NC + c) * BR + r] = ls;
        barrier(CLK_LOCAL_MEM_FENCE);
        const float alpha = exp2(m - mt);
        m = mt;
        l *= alpha;
        for (int i = 0; i < NC; i++) l += part[(NC + i) * BR + r];
        for (int e = 0; e < DS; e++) acc[e] *= alpha;
        if (k0 <= qi)  // else every probability of the step is 0 for the row
            for (int j = 0; j < BC; j++) axpy_local(acc, sc[r * SP + j], kv + j * KP + c * DS);
    }
    if (qi >= T) return;
    const float inv = 1.0f / l;
    __global float* o = out + ((size_t)b * T + qi) * C + h * D + c * DS;
    for (int e = 0; e < DS; e++) o[e] = acc[e] * inv;
    if (c == 0) lse[(size_t)z * T + qi] = m + log2(l);
}

__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void flash_portable_backward_dq(const int T, __global const float* restrict qkv, __global const float* restrict dout,
                                __global const float* restrict out, __global const float* restrict lse,
                                __global float* restrict delta, __global float* restrict dqkv, const uint seed,
                                const uint site, const float p)
{
    __local float kt[BC * KP], vt[BC * KP];
    __local float dst[BR * SP];
    const int lid = get_local_id(0), r = lid % BR, c = lid / BR, z = get_global_id(1), b = z / H, h = z % H;
    const int q0 = (get_num_groups(0) - 1 - get_group_id(0)) * BR, qi = q0 + r, qc = min(qi, T - 1);
    __global const float* x = qkv + (size_t)b * T * C3;
    float qv[D], dov[D], dacc[DS];
    float dl = 0.0f;
    for (int d = 0; d < D; d++) {
        const size_t at = ((size_t)b * T + qc) * C + h * D + d;
        qv[d] = RND(x[(size_t)qc * C3 + h * D + d]) * SL2;
        dov[d] = RND(dout[at]);
        dl = fma(dout[at], out[at], dl);
    }
    if (c == 0 && qi < T) delta[(size_t)z * T + qi] = dl;
    for (int e = 0; e < DS; e++) dacc[e] = 0.0f;
    const float lrow = lse[(size_t)z * T + qc], keep_scale = 1.0f / (1.0f - p);
    const uint row = ((uint)z * T + (uint)qi) * (uint)T;
    const int kend = min(T, q0 + BR);
    for (int k0 = 0; k0 < kend; k0 += BC) {
        barrier(CLK_LOCAL_MEM_FENCE);
        stage(kt, x, C3, C + h * D, k0, T);
        stage(vt, x, C3, 2 * C + h * D, k0, T);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int u = 0; u < CS; u++) {
            const int j = c + NC * u, key = k0 + j;
            float ds = 0.0f;
            if (key <= qi && key < T) {
                const float pr = exp2(dot_local(qv, kt + j * KP) - lrow);
                float dp = dot_local(dov, vt + j * KP);
                if (p > 0.0f) dp = dropout_keep(seed, site, row + (uint)key, p) ? dp * keep_scale : 0.0f;
                ds = pr * (dp - dl);
            }
            dst[r * SP + j] = RND(ds);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = 0; j < BC; j++) {
            const float ds = dst[r * SP + j];
            axpy_local(dacc, ds, kt + j * KP + c * DS);
        }
    }
    if (qi >= T) return;
    __global float* g = dqkv + ((size_t)b * T + qi) * C3 + h * D + c * DS;
    for (int e = 0; e < DS; e++) g[e] = dacc[e] * SCALE;
}

__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void flash_portable_backward_dkv(const int T, __global const float* restrict qkv, __global const float* restrict dout,
                                 __global const float* restrict lse, __global const float* restrict delta,
                                 __global float* restrict dqkv, const uint seed, const uint site, const float p)
{
    __local float qt[BC * KP], dob[BC * KP];
    __local float pt[BR * SP], dst[BR * SP];
    __local float lq[BC], dq[BC];
    const int lid = get_local_id(0), r = lid % BR, c = lid / BR, z = get_global_id(1), b = z / H, h = z % H;
    const int k0 = get_group_id(0) * BR, key = k0 + r, kc = min(key, T - 1);
    __global const float* x = qkv + (size_t)b * T * C3;
    __global const float* g = dout + (size_t)b * T * C;
    float kv[D], vv[D], dk[DS], dv[DS];
    for (int d = 0; d < D; d++) {
        kv[d] = RND(x[(size_t)kc * C3 + C + h * D + d]) * SL2;
        vv[d] = RND(x[(size_t)kc * C3 + 2 * C + h * D + d]);
    }
    for (int e = 0; e < DS; e++) dk[e] = dv[e] = 0.0f;
    const float keep_scale = 1.0f / (1.0f - p);
    for (int q0 = k0; q0 < T; q0 += BC) {  // queries before k0 see no key of this block
        barrier(CLK_LOCAL_MEM_FENCE);
        stage(qt, x, C3, h * D, q0, T);
        stage(dob, g, C, h * D, q0, T);
        for (int i = get_local_id(0); i < BC; i += NT) {
            lq[i] = q0 + i < T ? lse[(size_t)z * T + q0 + i] : 0.0f;
            dq[i] = q0 + i < T ? delta[(size_t)z * T + q0 + i] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int u = 0; u < CS; u++) {
            const int i = c + NC * u, qi = q0 + i;
            float pd = 0.0f, ds = 0.0f;
            if (qi >= key && qi < T && key < T) {
                const float pr = exp2(dot_local(kv, qt + i * KP) - lq[i]);
                float dp = dot_local(vv, dob + i * KP);
                pd = pr;
                if (p > 0.0f) {
                    const int kept = dropout_keep(seed, site, ((uint)z * T + (uint)qi) * (uint)T + (uint)key, p);
                    pd = kept ? pr * keep_scale : 0.0f;
                    dp = kept ? dp * keep_scale : 0.0f;
                }
                ds = pr * (dp - dq[i]);
            }
            pt[r * SP + i] = RND(pd);
            dst[r * SP + i] = RND(ds);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = 0; i < BC; i++) {
            const float pd = pt[r * SP + i], ds = dst[r * SP + i];
            axpy_local(dv, pd, dob + i * KP + c * DS);
            axpy_local(dk, ds, qt + i * KP + c * DS);
        }
    }
    if (key >= T) return;
    __global float* o = dqkv + ((size_t)b * T + key) * C3 + h * D + c * DS;
    for (int e = 0; e < DS; e++) {
        o[C + e] = dk[e] * SCALE;
        o[2 * C + e] = dv[e];
    }
}

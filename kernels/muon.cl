// Muon's elementwise parts (the Newton-Schulz products run on the batched GEMM: clgpt/ops/muon.py). Flat float
// buffers. The matrices of one shape (R, C), n = R*C floats each, are orthogonalised together: `offs[g]` is where
// matrix g starts in the flat buffer (a tensor's offset, plus e*R*C for expert e); the stack holds them at a
// stride (matrix g at g*ld, ld >= n); g = get_global_id(1) (get_group_id(0) for muon_norms).
//   muon_momentum:   g = grad[j] * s (s = norm[1], the global clip factor; grad keeps its value)
//                    buf[j] = lerp(buf[j], g, 1 - mu);  u[j] = nesterov ? lerp(g, buf[j], mu) : buf[j]
//                    (lerp(a, b, w) = a + w (b - a), as torch.optim.Muon writes it), j < n
//   muon_norms:      scale[g] = 1 / max(||x[offs[g] .. + n)||_F, eps): work-group g, `parts` work-items, item i
//                    the squares of chunk i (chunk = ceil(n / parts)), then item 0 their sum in order of i
//   muon_scale:      y[g*ld + j] = x[offs[g] + j] * scale[g]                  (X0 = U / max(||U||_F, eps))
//   The GPU form of the two (a stack of a few matrices gave muon_norms a work-group each, a few hundred work-items
//   walking chunks apart: ~270 us a shape on an H100):
//   muon_norm_parts: part[g*parts + p] = the squares of chunk p of matrix g (chunk floats, the last one clipped at
//                    n): work-group (p, g) of NORM_LOCAL work-items, item i its elements i, i + NORM_LOCAL, ...,
//                    then a tree over the items' sums
//   muon_scale_parts: muon_scale, each work-group first summing the parts of its matrix g by the same tree
//                    (item i: parts i, i + NORM_LOCAL, ...), scale = 1 / max(sqrt(sum), eps); item j of the
//                    get_global_size(0) scales entries j, j + get_global_size(0), ...
//   muon_poly:       P[j] = c A A[j] + (b A[j] + a I), P holding c A A (the batched GEMM's), r x r matrices
//                    ld >= r*r floats apart, j < total = count * ld     (X' = a X + (b A + c A A) X = P X)
//   muon_gram_poly:  the batched form's A and P (r x r, stacks rr floats apart): A[g rr + e] = the splits[g] parts
//                    of matrix g's Gram product summed in order (part[(g smax + s) rr + e]), entry e = (i, j) read
//                    from (i, j) where i >= j, else from (j, i) (the product ran on the tiles on or below the
//                    diagonal alone: A is symmetric); P[g rr + e] = b A + a I, to which the A A product then adds
//                    c A A (ACCUM); work-groups of GP_TILE x GP_TILE entries (below)
//   muon_update:     p[offs[g] + j] = p[offs[g] + j] * decay - lr_adj * o[g*ld + j]  (decay = 1 - lr wd; o: NS's)
// -D OUT16 1 (the batched form on the bf16 GEMM): muon_scale_parts writes the stack, muon_gram_poly A, as bf16
// (rounded as kernels/precision.cl's bf16_bits: the rounding the products' operands get anyway).
// Fixed orders of summation: deterministic.
#ifndef OUT16
#define OUT16 0
#endif
#if OUT16
#include "precision.cl"
#define STACK_T ushort
#define STACK_V(x) ((ushort)bf16_bits(x))
#else
#define STACK_T float
#define STACK_V(x) (x)
#endif

__kernel void muon_momentum(const int n, const float mu, const int nesterov, __global const float* grad,
                            __global float* buf, __global float* u, __global const float* norm)
{
    const int j = get_global_id(0);
    if (j >= n) return;
    const float g = grad[j] * norm[1];
    const float b = buf[j] + (1.0f - mu) * (g - buf[j]);
    buf[j] = b;
    u[j] = nesterov ? g + mu * (b - g) : b;
}

#define NORM_PARTS_MAX 256

__kernel void muon_norms(const int n, const int chunk, const float eps, __global const int* offs,
                         __global const float* x, __global float* scale)
{
    __local float part[NORM_PARTS_MAX];
    const int i = get_local_id(0), parts = get_local_size(0), g = get_group_id(0);
    const int lo = i * chunk, hi = min(n, lo + chunk);
    __global const float* xg = x + offs[g];
    float s = 0.0f;
    for (int j = lo; j < hi; j++) s += xg[j] * xg[j];
    part[i] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (i != 0) return;
    float t = 0.0f;
    for (int k = 0; k < parts; k++) t += part[k];
    scale[g] = 1.0f / fmax(sqrt(t), eps);
}

#define NORM_LOCAL 128  // clgpt/ops/muon.py NORM_LOCAL: the work-group size of the two kernels below

// s[0] = the sum of s[0 .. NORM_LOCAL) over a fixed tree (i: this work-item); every item may read s[0] after it
inline void tree_sum(__local float* s, const int i)
{
    for (int h = NORM_LOCAL / 2; h > 0; h >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (i < h) s[i] += s[i + h];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

__kernel __attribute__((reqd_work_group_size(NORM_LOCAL, 1, 1)))
void muon_norm_parts(const int n, const int chunk, __global const int* offs, __global const float* x,
                     __global float* part)
{
    __local float s[NORM_LOCAL];
    const int i = get_local_id(0), p = get_group_id(0), parts = get_num_groups(0), g = get_group_id(1);
    const int hi = min(n, (p + 1) * chunk);
    __global const float* xg = x + offs[g];
    float t = 0.0f;
    for (int j = p * chunk + i; j < hi; j += NORM_LOCAL) t += xg[j] * xg[j];
    s[i] = t;
    tree_sum(s, i);
    if (i == 0) part[g * parts + p] = s[0];
}

__kernel __attribute__((reqd_work_group_size(NORM_LOCAL, 1, 1)))
void muon_scale_parts(const int n, const int ld, const int parts, const float eps, __global const int* offs,
                      __global const float* x, __global const float* part, __global STACK_T* y)
{
    __local float s[NORM_LOCAL];
    const int i = get_local_id(0), g = get_group_id(1), step = get_global_size(0);
    float t = 0.0f;
    for (int k = i; k < parts; k += NORM_LOCAL) t += part[g * parts + k];
    s[i] = t;
    tree_sum(s, i);
    const float scale = 1.0f / fmax(sqrt(s[0]), eps);
    __global const float* xg = x + offs[g];
    __global STACK_T* yg = y + (long)g * ld;
    for (int j = get_global_id(0); j < n; j += step) yg[j] = STACK_V(xg[j] * scale);
}

__kernel void muon_scale(const int n, const int ld, __global const int* offs, __global const float* x,
                         __global const float* scale, __global float* y)
{
    const int j = get_global_id(0), g = get_global_id(1);
    if (j < n) y[(long)g * ld + j] = x[offs[g] + j] * scale[g];
}

__kernel void muon_poly(const int total, const int r, const int ld, const float a, const float b,
                        __global const float* A, __global float* P)
{
    const int j = get_global_id(0);
    const int k = j % ld;
    if (j >= total || k >= r * r) return;
    const float q = b * A[j] + (k / r == k % r ? a : 0.0f);
    P[j] = P[j] + q;
}

#define GP_TILE 16  // clgpt/ops/muon.py GP_TILE: muon_gram_poly's work-groups, GP_TILE x GP_TILE entries

// Work-group (tj, ti, g): the entries (i, j) of tile (ti, tj); it sums the parts of the tile on or below the
// diagonal (ti, tj ordered), reading rows along x, and takes each entry from there directly or transposed
// through local memory, so that the upper half's mirror reads stay coalesced.
__kernel __attribute__((reqd_work_group_size(GP_TILE, GP_TILE, 1)))
void muon_gram_poly(const int r, const int rr, const int smax, __global const int* splits, const float a,
                    const float b, __global const float* part, __global STACK_T* A, __global float* P)
{
    __local float t[GP_TILE][GP_TILE + 1];
    const int x = get_local_id(0), y = get_local_id(1);
    const int tj = get_group_id(0), ti = get_group_id(1), g = get_group_id(2);
    const int si = max(ti, tj) * GP_TILE + y, sj = min(ti, tj) * GP_TILE + x;  // the source tile's entry
    float v = 0.0f;
    if (si < r && sj < r) {
        __global const float* pg = part + (long)g * smax * rr + si * r + sj;
        v = pg[0];
        for (int s = 1; s < splits[g]; s++) v += pg[(long)s * rr];
    }
    t[y][x] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int i = ti * GP_TILE + y, j = tj * GP_TILE + x;
    if (i >= r || j >= r) return;
    const float e = (ti > tj || (ti == tj && y >= x)) ? t[y][x] : t[x][y];  // (i, j), else its mirror (j, i)
    A[(long)g * rr + i * r + j] = STACK_V(e);
    P[(long)g * rr + i * r + j] = b * e + (i == j ? a : 0.0f);
}

__kernel void muon_update(const int n, const int ld, __global const int* offs, __global float* p,
                          __global const float* o, const float decay, const float lr_adj)
{
    const int j = get_global_id(0), g = get_global_id(1);
    if (j < n) p[offs[g] + j] = p[offs[g] + j] * decay - lr_adj * o[(long)g * ld + j];
}

// Token + position embedding.  -D: C
// tokens (N) int with N = B*T rows; wte (V,C), wpe (n_ctx,C); out (N,C).
//   forward:       out[n,c] = wte[tokens[n],c] + wpe[n % T,c]
//   backward_wte:  dwte[v,c] += sum over rows n with tokens[n] == v of dout[n,c]
//                  The host lists the rows sorted by token (order), the distinct tokens (rows) and where
//                  each one's run starts (starts, n_rows+1 entries): one work-item per (distinct token,
//                  channel) sums its run in order. Deterministic, no atomics.
//   backward_wpe:  dwpe[t,c] += sum_b dout[b*T+t,c]
#ifndef C
#error "C must be defined"
#endif

__kernel void embedding_forward(const int N, const int T, __global const int* tokens,
                                __global const float* wte, __global const float* wpe, __global float* out)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    out[n * C + c] = wte[tokens[n] * C + c] + wpe[(n % T) * C + c];
}

// CPUs (tuning's cpu_vec): the same sums a row a work-item, float8 where whole (the 2-D form's one-float
// work-items cost more than the adds there). Global size (N).
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
__kernel void embedding_forward_rows(const int N, const int T, __global const int* tokens,
                                     __global const float* wte, __global const float* wpe, __global float* out)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* e = wte + tokens[n] * C;
    __global const float* p = wpe + (n % T) * C;
    __global float* o = out + n * C;
    int c = 0;
    for (; c + 8 <= C; c += 8)
        *(__global float8u*)(o + c) = *(__global const float8u*)(e + c) + *(__global const float8u*)(p + c);
    for (; c < C; c++) o[c] = e[c] + p[c];
}

__kernel void embedding_backward_wte(const int n_rows, __global const int* rows, __global const int* starts,
                                     __global const int* order, __global const float* dout,
                                     __global float* dwte)
{
    const int c = get_global_id(0), r = get_global_id(1);
    if (c >= C || r >= n_rows) return;
    float s = 0.0f;
    for (int i = starts[r]; i < starts[r + 1]; i++) s += dout[order[i] * C + c];
    dwte[rows[r] * C + c] += s;
}

__kernel void embedding_backward_wpe(const int B, const int T, __global const float* dout, __global float* dwpe)
{
    const int c = get_global_id(0), t = get_global_id(1);
    if (c >= C || t >= T) return;
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += dout[(b * T + t) * C + c];
    dwpe[t * C + c] += s;
}

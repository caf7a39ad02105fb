// Bias gradients: db (N) += the column sums of dy (M, N), rows in a fixed order (deterministic). bias_backward
// (one work-item a column), bias_v8 CPUs (PoCL: float8 columns, the same sums), bias_partial + bias_final GPUs.
// float8 at 4-byte alignment (plain vector loads, inlined): the CPU forms' rows start anywhere
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define VLD(p) (*(__global const float8u*)(p))
#define VST(p, v) (*(__global float8u*)(p) = (v))

// db (N) += sum over the M rows of dy (M,N), rows summed in order (one work-item per column: CPUs).
__kernel void bias_backward(const int M, const int N, __global const float* dy, __global float* db)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    float s = 0.0f;
    for (int m = 0; m < M; m++) s += dy[m * N + n];
    db[n] += s;
}

// GPUs, two stages with fixed orders: part[r*N+n] = sum of rows [r*rc, (r+1)*rc) of column n (2-D launch,
// (n, r)); then bias_final adds the parts into db.
__kernel void bias_partial(const int M, const int N, const int rc, __global const float* dy, __global float* part)
{
    const int n = get_global_id(0), r = get_global_id(1);
    if (n >= N || r * rc >= M) return;
    const int hi = min(M, (r + 1) * rc);
    float s = 0.0f;
    for (int m = r * rc; m < hi; m++) s += dy[m * N + n];
    part[r * N + n] = s;
}

// bias_final: db[n] += the sum of part[r * N + n] over r < R; work-group (16 columns, 16 slices): slice j adds
// the parts of its run of ceil(R / 16) in order, then the first slice adds the slices' sums in order (fixed
// orders: deterministic; 16 chains of loads in flight a column, not one; 256 work-items, what any GPU allows).
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void bias_final(const int R, const int N, __global const float* part, __global float* db)
{
    const int n = get_global_id(0), j = get_local_id(1), run = (R + 15) / 16;
    __local float sums[16][16];
    float s = 0.0f;
    if (n < N)
        for (int r = j * run; r < min(R, (j + 1) * run); r++) s += part[r * N + n];
    sums[j][get_local_id(0)] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (j == 0 && n < N) {
        float t = sums[0][get_local_id(0)];
        for (int i = 1; i < 16; i++) t += sums[i][get_local_id(0)];
        db[n] += t;
    }
}

// db (N) += sum over the M rows of dy (M,N): one work-item per 8 adjacent columns, contiguous float8 row
// loads, rows summed in order (the order of matmul.cl's bias_backward: the same sums, bit for bit).
__kernel void bias_backward_v8(const int M, const int N, __global const float* dy, __global float* db)
{
    const int n0 = get_global_id(0) * 8;
    if (n0 >= N) return;
    if (n0 + 8 <= N) {
        float8 s = 0.0f;
        for (int m = 0; m < M; m++) s += VLD(dy + (size_t)m * N + n0);
        VST(db + n0, VLD(db + n0) + s);
    } else {
        for (int n = n0; n < N; n++) {
            float s = 0.0f;
            for (int m = 0; m < M; m++) s += dy[(size_t)m * N + n];
            db[n] += s;
        }
    }
}

// Transposes and strided copies of fp32 matrices for the GEMMs (clgpt/ops/gemm/cpu.py): transpose, any device;
// CPUs (PoCL, clgpt/device/tuning.py's transpose_v8 and ld_pad rows): transpose_v8, transpose_ld_v8, copy_ld_v8 with
// explicit float8 vectors (the AVX2 width PoCL targets; it does not vectorise loops whose accesses are strided
// across work-items).
// out (N,K) = in (K,N).T; one work-item per 8x8 block.
__kernel void transpose(const int K, const int N, __global const float* restrict in, __global float* restrict out)
{
    const int n0 = get_global_id(0) * 8, k0 = get_global_id(1) * 8;
    if (n0 >= N || k0 >= K) return;
    const int nk = min(8, K - k0), nn = min(8, N - n0);
    for (int n = 0; n < nn; n++)
        for (int k = 0; k < nk; k++) out[(n0 + n) * K + k0 + k] = in[(k0 + k) * N + n0 + n];
}

// float8 at 4-byte alignment (plain vector loads, inlined): the CPU forms' rows start anywhere
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define VLD(p) (*(__global const float8u*)(p))
#define VST(p, v) (*(__global float8u*)(p) = (v))

// out (N,K) = in (K,N).T (matmul.cl's transpose, same launch arguments): one work-item per 16 (k) x 8 (n)
// block, read as 16 float8 rows, turned by two 8x8 register transposes (unpack, shuffle, 128-bit lane
// swaps) and written as 8 rows of 16 contiguous floats. Partial blocks at the edges go element by element.
// Global size (ceil(N / 8), ceil(K / 16)).
#define SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
inline void tr8(const float8 r0, const float8 r1, const float8 r2, const float8 r3, const float8 r4,
                const float8 r5, const float8 r6, const float8 r7, __global float* o, const int ldo)
{
    const float8 t0 = SHUF(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = SHUF(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t2 = SHUF(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = SHUF(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t4 = SHUF(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = SHUF(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t6 = SHUF(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = SHUF(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 s0 = SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), s1 = SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s2 = SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), s3 = SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s4 = SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), s5 = SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 s6 = SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), s7 = SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    VST(o, SHUF(s0, s4, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + ldo, SHUF(s1, s5, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 2 * ldo, SHUF(s2, s6, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 3 * ldo, SHUF(s3, s7, 0, 1, 2, 3, 8, 9, 10, 11));
    VST(o + 4 * ldo, SHUF(s0, s4, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 5 * ldo, SHUF(s1, s5, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 6 * ldo, SHUF(s2, s6, 4, 5, 6, 7, 12, 13, 14, 15));
    VST(o + 7 * ldo, SHUF(s3, s7, 4, 5, 6, 7, 12, 13, 14, 15));
}

inline void transpose_blk(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                          const int ldo)
{
    const int n0 = get_global_id(0) * 8, k0 = get_global_id(1) * 16;
    if (n0 >= N || k0 >= K) return;
    if (n0 + 8 <= N && k0 + 16 <= K) {
        __global const float* p = in + (size_t)k0 * N + n0;
        for (int h = 0; h < 2; h++, p += 8 * (size_t)N)
            tr8(VLD(p), VLD(p + N), VLD(p + 2 * N), VLD(p + 3 * N), VLD(p + 4 * N), VLD(p + 5 * N),
                VLD(p + 6 * N), VLD(p + 7 * N), out + (size_t)n0 * ldo + k0 + 8 * h, ldo);
        return;
    }
    const int nk = min(16, K - k0), nn = min(8, N - n0);
    for (int n = 0; n < nn; n++)
        for (int k = 0; k < nk; k++) out[(size_t)(n0 + n) * ldo + k0 + k] = in[(size_t)(k0 + k) * N + n0 + n];
}

__kernel void transpose_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out)
{
    transpose_blk(K, N, in, out, K);
}

// transpose_v8 into rows ldo >= K floats apart (out row n at out + n * ldo; the padding is not written):
// matmul_rb's op(B) with a leading dimension off the powers of two (engine.py, ld_pad).
__kernel void transpose_ld_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                              const int ldo)
{
    transpose_blk(K, N, in, out, ldo);
}

// out (K,N), rows ldo floats apart = in (K,N) contiguous; 64 floats of a row a work-item (float8 where whole).
// Global size (ceil(N / 64), K).
__kernel void copy_ld_v8(const int K, const int N, __global const float* restrict in, __global float* restrict out,
                         const int ldo)
{
    const int c0 = get_global_id(0) * 64, k = get_global_id(1);
    if (c0 >= N || k >= K) return;
    __global const float* p = in + (size_t)k * N;
    __global float* o = out + (size_t)k * ldo;
    if (c0 + 64 <= N) {
#pragma unroll
        for (int j = 0; j < 64; j += 8) VST(o + c0 + j, VLD(p + c0 + j));
        return;
    }
    for (int c = c0; c < N; c++) o[c] = p[c];
}

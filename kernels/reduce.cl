// Work-group reductions shared by the GPU row kernels (layernorm.cl, attention.cl, xent.cl include this file;
// the loader builds with -I kernels/). One work-group of LW work-items; a fixed-order tree: deterministic.
//   wg_reduce(red, v, is_max): max (is_max) or sum of v over the work-group; red: __local float[LW]
#ifndef CLGPT_REDUCE_CL
#define CLGPT_REDUCE_CL
#ifndef LW
#define LW 64
#endif

inline float wg_reduce(__local float* red, float v, const int is_max)
{
    const int l = get_local_id(0);
    red[l] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = LW / 2; s > 0; s >>= 1) {
        if (l < s) red[l] = is_max ? fmax(red[l], red[l + s]) : red[l] + red[l + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

inline float wg_sum(__local float* red, const float v) { return wg_reduce(red, v, 0); }
#endif

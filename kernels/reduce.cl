// Work-group reductions shared by the GPU row kernels (layernorm.cl, rmsnorm.cl, attention.cl, xent.cl, adamw.cl,
// moe.cl include this file). One work-group of LW work-items, a fixed order: deterministic.
//   wg_reduce(red, v, is_max): max (is_max) or sum of v over the work-group; red: __local float[LW]
// Two forms:
//   local memory (the default): a tree over red, log2(LW) + 2 barriers.
//   -D SUBGROUP (devices with cl_khr_subgroups or cl_intel_subgroups, clgpt/device/capabilities.py's `subgroup`):
//     each sub-group reduces in registers (sub_group_reduce_add / _max: an order fixed by the device and the
//     build), its first work-item puts that in red[sub-group id], one barrier, and every work-item adds the
//     sub-groups' values in order 0, 1, ... (the same bits in all), one more barrier before red is reused; a
//     work-group of one sub-group needs no barrier. SUBGROUP > 0 fixes the sub-group size at build time
//     (SG_KERNEL: cl_intel_required_subgroup_size); SUBGROUP 0 takes the size the compiler picks.
// SG_KERNEL goes before `void` on every kernel that calls wg_reduce (empty without a fixed size).
#ifndef CLGPT_REDUCE_CL
#define CLGPT_REDUCE_CL
#ifndef LW
#define LW 64
#endif

#if defined(SUBGROUP) && SUBGROUP > 0
#define SG_KERNEL __attribute__((intel_reqd_sub_group_size(SUBGROUP)))
#else
#define SG_KERNEL
#endif

#ifdef SUBGROUP
#if defined(cl_khr_subgroups)
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
inline float wg_reduce(__local float* red, float v, const int is_max)
{
    if (is_max) v = sub_group_reduce_max(v);
    else v = sub_group_reduce_add(v);
    const uint ns = get_num_sub_groups();
    if (ns == 1) return v;
    if (get_sub_group_local_id() == 0) red[get_sub_group_id()] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float r = red[0];
    for (uint j = 1; j < ns; j++) r = is_max ? fmax(r, red[j]) : r + red[j];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}
#else
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
#endif

inline float wg_sum(__local float* red, const float v) { return wg_reduce(red, v, 0); }
#endif

// What clgpt/device/capabilities.py reads once per device (-D SUBGROUP_PROBE, SUBGROUP as above), in a work-group
// of 128 as (128, 1) and as (32, 4): for work-item t = X y + x (X the work-group's width), out[t] = its sub-group
// size | sub-group id << 8 | id in the sub-group << 16, and out[128 + t] = the sum over its sub-group of the ids t
// (as floats: exact). The row kernels need sub-groups of consecutive ids, dimension 0 first, and a reduce that adds.
#ifdef SUBGROUP_PROBE
__kernel SG_KERNEL void subgroup_probe(__global uint* out)
{
    const uint t = get_local_id(1) * get_local_size(0) + get_local_id(0);
    out[t] = get_sub_group_size() | get_sub_group_id() << 8 | get_sub_group_local_id() << 16;
    out[128 + t] = (uint)sub_group_reduce_add((float)t);
}
#endif

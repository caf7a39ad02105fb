// The row-slice machinery of the GPU norms, shared by layernorm.cl and rmsnorm.cl (-D RW, C):
// C % 128 == 0 and C <= 2048, so that a row fits in registers. A row is a 32-work-item slice, RW rows a
// work-group; work-item l of a row holds columns 4l + 128i (i < ROW_NB = C/128) as float4s (coalesced loads,
// stores).
// A row's sum: each work-item sums its values in order (i, then .x .y .z .w), writes that partial to local
// memory, one barrier, then every work-item of the row sums the 32 partials itself in order 0..31 (broadcast
// reads): the same bits in all 32, no second barrier, no tree.
// With -D SUBGROUP (a sub-group size that divides 32, fixed at build time by cl_intel_required_subgroup_size:
// clgpt/device/capabilities.py's `subgroup`), a row's 32 work-items are 32 / SUBGROUP whole sub-groups (local ids
// in order, dimension 0 first: the capabilities probe checks the device forms them so), each summing its values in
// registers (sub_group_reduce_add: an order fixed by the device and the build). SUBGROUP 32: that is the row's
// sum, no local memory and no barrier; 8 or 16: each sub-group's first work-item writes its sum, one barrier,
// then the 32 / SUBGROUP sums in order. A kernel reduces a row's partial v as
//     const float sp = row_part(v); ROW_PUT(p, l, sp); ROW_BARRIER(); ... ROW_SUM(p, sp)
// with p the row's 32 local floats (16-byte aligned) and l its local id 0..31; ROW_KERNEL before its `void`.
// The weight gradients (dw, and LayerNorm's db): each work-group's sums over its rows, one part a work-group
// (slot_sums_to_part), then the parts added by a *_param_final_rows kernel (parts_sum). Fixed orders
// throughout: deterministic.
// The buffers are read and written as float4: 16-byte aligned (clgpt's buffers and sub-buffers are).
#ifndef CLGPT_NORM_ROWS_CL
#define CLGPT_NORM_ROWS_CL
#if C % 128 != 0 || C > 2048
#error "the row-slice kernels (RW) need C % 128 == 0 and C <= 2048"
#endif
#define ROW_NB (C / 128)  // float4s of a row a work-item holds

// The backward's DX_TILED 1 (N a multiple of 64): also dx's bf16 copy, of the values stored, in matmul_wgmma.cl's
// tiled layout (Rp = N), the copy the products after it read (dx is the next residual branch's gradient); its
// kernels take the copy's buffer as DX_TILED_ARGS.
#ifndef DX_TILED
#define DX_TILED 0
#endif
#if DX_TILED
#include "precision.cl"
#define DX_TILED_ARGS , __global uint2* dx16
#else
#define DX_TILED_ARGS
#endif

#if defined(SUBGROUP) && SUBGROUP > 0
#if 32 % SUBGROUP != 0
#error "the row-slice kernels' sub-group form needs a sub-group size that divides 32"
#endif
#define ROW_SG SUBGROUP
#define ROW_KERNEL __attribute__((intel_reqd_sub_group_size(SUBGROUP)))
#else
#define ROW_SG 0
#define ROW_KERNEL
#endif

// p: one row's 32 partials (__local, 16-byte aligned) -> their sum in order 0..31
inline float row_sum32(__local const float* p)
{
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float4 q = vload4(j, p);
        s += q.x; s += q.y; s += q.z; s += q.w;
    }
    return s;
}

#if ROW_SG
#if defined(cl_khr_subgroups)
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
inline float row_part(const float v) { return sub_group_reduce_add(v); }
#else
inline float row_part(const float v) { return v; }
#endif
#if ROW_SG == 32
#define ROW_PUT(p, l, v)
#define ROW_BARRIER()
#define ROW_SUM(p, v) (v)
#elif ROW_SG
// p: one row's 32 / ROW_SG sub-group sums -> their sum in order
inline float row_sum_sg(__local const float* p)
{
    float s = p[0];
#pragma unroll
    for (int j = 1; j < 32 / ROW_SG; j++) s += p[j];
    return s;
}
#define ROW_PUT(p, l, v) if ((l) % ROW_SG == 0) (p)[(l) / ROW_SG] = (v)
#define ROW_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define ROW_SUM(p, v) row_sum_sg(p)
#else
#define ROW_PUT(p, l, v) (p)[l] = (v)
#define ROW_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define ROW_SUM(p, v) row_sum32(p)
#endif

// Column block i (columns 128i .. 128i + 127) of the work-group's part: NS (1 or 2) sums a column, work-item
// t = r * 32 + l holding row-slot r's float4 column l of the first (a0) and second (a1) in registers. They go
// through local memory l0, l1 (RW * 32 float4s each; l1 unused when NS == 1) and work-item j < 32 NS adds float4
// column j & 31 of sum j / 32 over r = 0..RW-1 in order into pw[(j / 32) * C/4 + 32i + (j & 31)]. Every
// work-item of the group calls it for i = 0, 1, ... in turn (barriers inside: the local buffers are written
// again only after every work-item has read them).
inline void slot_sums_to_part(const int NS, const int t, const int i, const float4 a0, const float4 a1,
                              __local float4* l0, __local float4* l1, __global float4* pw)
{
    l0[t] = a0;
    if (NS > 1) l1[t] = a1;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = t; j < 32 * NS; j += 32 * RW) {
        __local const float4* c = (j < 32 ? l0 : l1) + (j & 31);
        float4 sum = c[0];
        for (int q = 1; q < RW; q++) sum += c[32 * q];
        pw[(j < 32 ? 0 : C / 4) + 32 * i + (j & 31)] = sum;
    }
    if (i + 1 < ROW_NB) barrier(CLK_LOCAL_MEM_FENCE);
}

// dw (and db when NS == 2) += the P parts, rows of NS * C floats (dw's C, then db's), in a fixed order. The
// caller's work-group is (8, 32), red its 32 * 8 local float4s: work-item (lq, j) sums float4 column
// q = get_global_id(0) (q < NS * C/4) of the parts over parts j, j + 32, ... in order; the 32 sums are added in
// order j = 0..31. 2-D launch: global (NS * C/4, 32), local (8, 32).
inline void parts_sum(const int P, const int NS, __global const float* part, __global float* dw,
                      __global float* db, __local float4* red)
{
    const int lq = get_local_id(0), j = get_local_id(1), q = get_global_id(0);
    __global const float4* p = (__global const float4*)part + q;
    float4 s = 0.0f;
#pragma unroll 4
    for (int r = j; r < P; r += 32) s += p[(size_t)r * (NS * C / 4)];
    red[j * 8 + lq] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (j > 0) return;
    float4 sum = red[lq];
    for (int k = 1; k < 32; k++) sum += red[k * 8 + lq];
    __global float4* o = q < C / 4 ? (__global float4*)dw + q : (__global float4*)db + (q - C / 4);
    *o += sum;
}
#endif

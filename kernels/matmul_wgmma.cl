// bf16 GEMM on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a), fp32 sums:
//   Cm (M,N) = alpha * op(A) @ op(B)^T [+ bias] [+ R] [+ Cm], then EPI (epilogue.cl), fp32 out;
//   SPLITK 1: raw partial sums of K chunk z (kc deep) to Cm + z M ldc, added up by splitk_reduce.
// A and B are bf16 copies that matmul_bf16.cl's to_bf16 writes with TILED 1 from a row-major fp32 matrix
// (R x C), padded with zeros to Rp rows and Cp columns (multiples of 64): Cp/64 x Rp/8 atoms of 8 rows x 64
// columns (1 KB), the atoms of one 64-column block back to back, row r of an atom 128 contiguous bytes with its
// 16-byte chunk c (columns 8c..8c+7) at chunk c ^ r. That is wgmma's 128-byte-swizzle layout both ways:
// - TA 0: A is M x K (rows m, columns k), K-major: rows m0..m0+BM-1 of k tile kt are one contiguous BM * 128
//   bytes (lda = A's Rp: a k tile's rows are lda * 128 bytes apart);
// - TA 1: A is K x M (rows k, columns m), M-major ("transposed", wgmma's imm-trans-a): k tile kt of the
//   64-column block mb (m 64mb..64mb+63) is one contiguous 8 KB (64 rows); lda = A's Rp (blocks lda * 128
//   bytes apart); and TB likewise for B (N x K, or with TB 1 K x N).
// So one copy of a matrix serves a product and its transpose: the forward's X @ W^T, the backward's dY @ W
// and dY^T @ X read the same copies of X, W and dY. Each tile comes by bulk copies (cp.async.bulk: the copy
// engine TMA uses, no tensor map needed) into local memory as it stands; a copy stops at the operand's padded
// extent ma / nb (rows for K-major, columns for M- / N-major), and the rows of a tile past it (stale local
// memory) reach only outputs past M or N, which are not stored.
//
// NVIDIA's OpenCL compiles for `.target sm_90`, where wgmma does not exist, so the sm_90a lines here are PTX
// comments "// @sm90a@ ..." that name their operands (%0.. as inline asm does; the compiler fills in the
// registers); clgpt/device/sm90a.py retargets the program's PTX to sm_90a, drops the comment marks, sets the local
// array `smem` to SMEM_BYTES (OpenCL C may declare only 48 KB) and builds the PTX as the program binary.
// bench/probe_sm90a.py is the smallest proof; bench/gemm_wgmma.py times this kernel against torch.matmul.
//
// Work-group: BM / 64 warpgroups (BM 128: 256 work-items), output tile BM x BN; warpgroup w owns rows
// 64w..64w+63, BN/2 fp32 accumulators a work-item (wgmma m64nBNk16's D fragment: warp q of the group holds
// rows 16q + g and 16q + g + 8, g = lane / 4, columns 8j + 2t and 8j + 2t + 1, t = lane % 4, j < BN/8:
// acc[4j..4j+3] = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)). STAGES k tiles in flight, one mbarrier each:
// work-item 0 arms it with the stage's bytes and starts the bulk copies, which complete it; everyone
// waits for its phase. A tile: a barrier (so the stage refilled next is no longer read), the copies of
// tile kt + AHEAD, the wait for tile kt, then 4 wgmma (k 16 each) and, with PIPE, a wait that leaves this
// tile's group in flight while the next one issues.
// -D: BM (64, 128, 256), BN (96 with TB 0, 128, 192, 256), TA, TB, STAGES, PIPE, SMEM_BYTES; BIAS RESID ACCUM EPI SPLITK as
// matmul_bf16.cl; GROUP, NGROUPS the mixture of experts' grouped products (below). WGMMA_EMULATE 1 (tests on CPUs,
// CLGPT_WGMMA_EMULATE): no PTX; work-item 0 copies each tile, a work-group barrier stands for the mbarrier wait,
// and each work-item sums its fragment of the wgmma products from the swizzled tiles in C.
//
// GROUP (clgpt/ops/grouped.py; the same contract as matmul.cl's GROUP, on copies of stacked operands):
// - GROUP 1: Cm rows offs[e] .. offs[e] + counts[e] - 1 = op(A) rows there @ op(B_e), B_e the e-th block of
//   bstride rows of B's copy (stacked along n without TB, along k with TB: bstride then a multiple of 64). A row
//   tile finds its group as gemm_offsets.cl does; a tile wholly past its group's rows leaves, the others store
//   all their rows (the rows up to the next group are padding, which nothing reads).
// - GROUP 2 (TA = TB = 1, weight gradients): C_e = Cm + e cstride (M x N) = op(A_e) @ op(B_e), both read from
//   row offs[e] (a multiple of 64) for counts[e] rows; work-group z along dimension 2 takes chunk z % GS of kc
//   rows (kc a multiple of 64) of group z / GS; with SPLITK its raw sums go to Cm + (s NGROUPS + e) M ldc, an
//   empty chunk writes nothing (splitk_reduce_grouped adds them). The k rows of a group's last tile past its
//   count are zeroed in local memory before the products read them, so whatever lies there (the next group's
//   rows, padding) adds nothing.
#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 256
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef PIPE
#define PIPE 1
#endif
#ifndef TA
#define TA 0
#endif
#ifndef TB
#define TB 0
#endif
#ifndef TILED_OUT
#define TILED_OUT 0
#endif
#include "epilogue.cl"
#include "precision.cl"

#define BK 64
#define NT (2 * BM)                    // work-items: BM / 64 warpgroups of 128
#define AHEAD (STAGES - 1 - PIPE)      // tiles in flight ahead of the one multiplied
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NACC (BN / 2)
// STAGE_OUT 1 (default): the output tile leaves through local memory as rows of float4, SO floats apart (BN + 8:
// the fragments' float2 stores free of bank conflicts), RPP rows a pass, the epilogue's loads of OB passes issued
// together (the stores may alias R: one load at a time otherwise, each waited out). EPI 3 loads gate's and up's
// quads and stores dgate's and dup's (ldc = 2N, a multiple of 8 for whole quads).
#ifndef STAGE_OUT
#define STAGE_OUT 1
#endif
// TILED_OUT (with STAGE_OUT, M and N multiples of 64): an output leaves as its bf16 tiled copy (precision.cl
// tiled_chunk, Rp = M) in O16 instead of fp32: 1 (EPI 1): gelu(c), E unwritten; 2 (EPI 2): c itself, Cm
// unwritten, and part[(gm / 64) N + gn] = the column sums of c over each 64 rows in row order (to_bf16's COLSUM
// sums, bit for bit); 3 (EPI 3): dgate | dup, the copy's rows 2N wide (= ldc), Cm unwritten, part unused. The
// copies and sums Ops would otherwise make from E or Cm in a second pass.
// OUT_BF16 (with STAGE_OUT, EPI 0, without SPLITK) for readers that take bf16: 1: Cm holds the output as bf16
// (row-major, ldc) instead of fp32 (the head's logits, which only the cross-entropy reads): half the bytes out;
// 2: the fp32 output and its bf16 copy (row-major, ldc) in O16 from ushort at16 (a multiple of 4: flash
// attention's copy of q | k | v, made here instead of in a pass of its own); 3: that copy alone, Cm unwritten (q | k
// | v in a forward whose backward reads only the copy).
#ifndef OUT_BF16
#define OUT_BF16 0
#endif
#if OUT_BF16 && (!STAGE_OUT || EPI || SPLITK || TILED_OUT || ACCUM)
#error OUT_BF16 goes through STAGE_OUT, without EPI, SPLITK, TILED_OUT or ACCUM
#endif
#if OUT_BF16 >= 2
#define TILED_ARGS , __global uint2* O16, const ulong at16
#elif TILED_OUT
#define TILED_ARGS , __global uint2* O16, __global float* part
#if !STAGE_OUT || TILED_OUT != EPI || SPLITK
#error TILED_OUT 1 goes with EPI 1, 2 with EPI 2, 3 with EPI 3, all through STAGE_OUT, without SPLITK
#endif
#else
#define TILED_ARGS
#endif
#ifndef GROUP
#define GROUP 0
#endif
#if GROUP
#define EXTRA_ARGS , const int kc, const int GS, const int bstride, const int cstride, \
    __global const int* counts, __global const int* offs
#if GROUP == 2 && !(TA && TB)
#error GROUP 2 reads both operands with their rows along k (TA 1, TB 1)
#endif
#if GROUP == 1 && SPLITK
#error GROUP 1 is not split along K
#endif
#else
#define EXTRA_ARGS SPLIT_ARGS
#endif
#define SO (BN + 8)
#define RPP (NT / (BN / 4))
#define OB 8
// BN 96 or 192: BN / 4 does not divide the work-items, nor RPP * OB the rows; the work-items past RPP rows and the
// rows past BM sit out
#if TB && BN % 64
#error BN 96 takes B with its rows along n (TB 0): with TB 1 its tile is whole 64-column blocks
#endif
#define PART_ROWS (NT % (BN / 4) != 0 || BM % (RPP * OB) != 0)
#define SMEM_NEED (STAGES * STAGE_BYTES + 64)  // the stages, then their mbarriers
#if WGMMA_EMULATE
#define SMEM_DECL SMEM_NEED
#else
#define SMEM_DECL (SMEM_NEED < 49152 ? SMEM_NEED : 49152)
#endif
#if STAGE_OUT && BM * SO * 4 > STAGES * STAGE_BYTES
#error STAGE_OUT needs BM * (BN + 8) floats of local memory: more stages
#endif
#if SMEM_NEED > 49152 && SMEM_BYTES != SMEM_NEED
#error SMEM_BYTES must be STAGES * (BM + BN) * 128 + 64: the size clgpt/device/sm90a.py gives the local array
#endif

// matrix descriptors, 128-byte swizzle, the tiles 1024-aligned (sm90a.py aligns the array): start >> 4,
// the leading and stride byte offsets >> 4. K-major: SBO 1024 bytes (8-row atoms; LBO unused), and k + 16 moves
// the start 32 bytes inside the atom. M- / N-major: LBO 8 KB (the next 64-wide block of m or n), SBO 1024
// bytes (the next 8 k rows), and k + 16 moves the start two atoms (2 KB).
inline ulong wgmma_desc(const uint addr, const uint lbo)
{
    return (ulong)((addr & 0x3FFFF) >> 4) | ((ulong)(lbo >> 4) << 16) | ((ulong)(1024 >> 4) << 32) | (1ul << 62);
}
#define MN_LBO (64 * 128)
#define KSTEP_K (32 >> 4)
#define KSTEP_MN (2048 >> 4)
#define STR_(x) #x
#define STR(x) STR_(x)
#define WGMMA_TRANS STR(TA) ", " STR(TB)  // imm-trans-a, imm-trans-b

#if !WGMMA_EMULATE
// local memory through its address (the array is larger than OpenCL C declares it)
inline void st_local2(const uint addr, const float x, const float y)
{
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
inline void st_local4(const uint addr, const float4 v)
{
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}
inline float ld_local(const uint addr)
{
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
inline float4 ld_local4(const uint addr)
{
    float x, y, z, w;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x), "=f"(y), "=f"(z), "=f"(w) : "r"(addr) : "memory");
    return (float4)(x, y, z, w);
}
#else
// emulated: local memory at byte offsets from the kernel's array `smem` (declared whole), read and written in C
#define LOCAL_AT(T, addr) (*(__local T*)((__local uchar*)smem + (addr)))
#define st_local2(addr, x, y) (LOCAL_AT(float2, addr) = (float2)((x), (y)))
#define st_local4(addr, v) (LOCAL_AT(float4, addr) = (v))
#define ld_local(addr) LOCAL_AT(float, addr)
#define ld_local4(addr) LOCAL_AT(float4, addr)
// element (r, k) of a tile at byte offset base, r its row (m or n), k < 64: K-major (T 0), rows of 128 bytes whose
// 16-byte chunk c lies at c ^ (r % 8); M- / N-major (T 1), 64-wide blocks of r, 8 KB apart, each 64 rows of k
// swizzled alike. One work-item's wgmma fragment (see above) is then sums over k of such elements.
#define TILE_OFF(r, k, T)                                                                                        \
    ((T) ? ((r) >> 6) * 8192 + (k) * 128 + (((((r) & 63) >> 3) ^ ((k) & 7)) << 4) + (((r) & 7) << 1)              \
         : (r) * 128 + ((((k) >> 3) ^ ((r) & 7)) << 4) + (((k) & 7) << 1))
#define TILE_AT(base, r, k, T) as_float((uint)LOCAL_AT(ushort, (base) + TILE_OFF(r, k, T)) << 16)
#endif

// WGMMA_TILE_ASM: the 4 wgmma m64nBNk16 of one k tile, then a wait until at most PIPE groups are pending;
// operands: the BN/2 accumulators, A's and B's descriptors, 1 (scale-d: accumulate), A's and B's k steps, PIPE.
#if BN == 96
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %50, 0;\n" \
    "// @sm90a@ mov.b64 da, %48; mov.b64 db, %49;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %51; add.s64 db, db, %52;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %51; add.s64 db, db, %52;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %51; add.s64 db, db, %52;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned %53; }\n"
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47])
#elif BN == 128
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %66, 0;\n" \
    "// @sm90a@ mov.b64 da, %64; mov.b64 db, %65;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %67; add.s64 db, db, %68;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %67; add.s64 db, db, %68;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %67; add.s64 db, db, %68;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned %69; }\n"
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63])
#elif BN == 192
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %98, 0;\n" \
    "// @sm90a@ mov.b64 da, %96; mov.b64 db, %97;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %99; add.s64 db, db, %100;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %99; add.s64 db, db, %100;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %99; add.s64 db, db, %100;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned %101; }\n"
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63]), "+f"(acc[64]), "+f"(acc[65]), "+f"(acc[66]), "+f"(acc[67]), "+f"(acc[68]), "+f"(acc[69]), "+f"(acc[70]), "+f"(acc[71]), "+f"(acc[72]), "+f"(acc[73]), "+f"(acc[74]), "+f"(acc[75]), "+f"(acc[76]), "+f"(acc[77]), "+f"(acc[78]), "+f"(acc[79]), "+f"(acc[80]), "+f"(acc[81]), "+f"(acc[82]), "+f"(acc[83]), "+f"(acc[84]), "+f"(acc[85]), "+f"(acc[86]), "+f"(acc[87]), "+f"(acc[88]), "+f"(acc[89]), "+f"(acc[90]), "+f"(acc[91]), "+f"(acc[92]), "+f"(acc[93]), "+f"(acc[94]), "+f"(acc[95])
#elif BN == 256
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %130, 0;\n" \
    "// @sm90a@ mov.b64 da, %128; mov.b64 db, %129;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %131; add.s64 db, db, %132;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %131; add.s64 db, db, %132;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ add.s64 da, da, %131; add.s64 db, db, %132;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, " WGMMA_TRANS ";\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned %133; }\n"
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63]), "+f"(acc[64]), "+f"(acc[65]), "+f"(acc[66]), "+f"(acc[67]), "+f"(acc[68]), "+f"(acc[69]), "+f"(acc[70]), "+f"(acc[71]), "+f"(acc[72]), "+f"(acc[73]), "+f"(acc[74]), "+f"(acc[75]), "+f"(acc[76]), "+f"(acc[77]), "+f"(acc[78]), "+f"(acc[79]), "+f"(acc[80]), "+f"(acc[81]), "+f"(acc[82]), "+f"(acc[83]), "+f"(acc[84]), "+f"(acc[85]), "+f"(acc[86]), "+f"(acc[87]), "+f"(acc[88]), "+f"(acc[89]), "+f"(acc[90]), "+f"(acc[91]), "+f"(acc[92]), "+f"(acc[93]), "+f"(acc[94]), "+f"(acc[95]), "+f"(acc[96]), "+f"(acc[97]), "+f"(acc[98]), "+f"(acc[99]), "+f"(acc[100]), "+f"(acc[101]), "+f"(acc[102]), "+f"(acc[103]), "+f"(acc[104]), "+f"(acc[105]), "+f"(acc[106]), "+f"(acc[107]), "+f"(acc[108]), "+f"(acc[109]), "+f"(acc[110]), "+f"(acc[111]), "+f"(acc[112]), "+f"(acc[113]), "+f"(acc[114]), "+f"(acc[115]), "+f"(acc[116]), "+f"(acc[117]), "+f"(acc[118]), "+f"(acc[119]), "+f"(acc[120]), "+f"(acc[121]), "+f"(acc[122]), "+f"(acc[123]), "+f"(acc[124]), "+f"(acc[125]), "+f"(acc[126]), "+f"(acc[127])
#else
#error BN is 96, 128, 192 or 256
#endif
#define WGMMA_WAIT0_ASM "// @sm90a@ wgmma.wait_group.sync.aligned 0;\n"

// BULK_COPY(d, src, bytes): a bulk copy of global src into local d on mbarrier bar_ (emulated: work-item 0
// copies at once; the wait for the tile is a work-group barrier)
#if WGMMA_EMULATE
#define BULK_COPY(d, src, bytes)                                                                       \
    for (int b_ = 0; b_ < (int)(bytes) / 16; b_++) LOCAL_AT(uint4, (d) + 16 * b_) = ((__global const uint4*)(src))[b_];
#else
#define BULK_COPY(d, src, bytes)                                                                       \
    asm volatile("// @sm90a@ cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "         \
                 "[%0], [%1], %2, [%3];" ::"r"(d), "l"(src), "r"(bytes), "r"(bar_) : "memory");
#endif
// FETCH(X, d, kk, o0, ld, ext, BX, TX): the bulk copies of k tile kk of an operand's rows (columns with TX)
// o0..o0+BX-1 into local d, on mbarrier bar_, stopping at its padded extent ext.
#define FETCH(X, d, kk, o0, ld, ext, BX, TX)                                                           \
    if (TX) {                                                                                          \
        for (int j_ = 0; j_ < BX / 64 && o0 + 64 * j_ < ext; j_++)                                     \
            BULK_COPY(d + j_ * 8192, X + ((size_t)(o0 / 64 + j_) * ld + (size_t)(kk) * 64) * 64, 8192)     \
    } else {                                                                                           \
        BULK_COPY(d, X + ((size_t)(kk) * ld + o0) * BK, min(BX, ext - o0) * 128)                       \
    }
// the bytes FETCH moves for one operand tile
#define FETCH_BYTES(o0, ext, BX, TX) ((TX) ? min(BX / 64, (ext - o0 + 63) / 64) * 8192 : min(BX, ext - o0) * 128)

__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void matmul_wgmma(const int M, const int N, const int Kp, __global const ushort* restrict A, const int lda,
                  const int ma, __global const ushort* restrict B, const int ldb, const int nb,
                  __global float* Cm, const int ldc, __global const float* restrict bias, __global const float* R,
                  const float alpha, __global float* E EXTRA_ARGS TILED_ARGS)
{
    __local uint4 smem[SMEM_DECL / 16];  // SMEM_BYTES in the PTX (see above); addressed through sbase only
    const int tid = get_local_id(0), wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int2 tile = tile_of_group();
    const int n0 = tile.x * BN, m0 = tile.y * BM;
    int kbeg = 0, kend = Kp;
    int ka = 0, kb = 0, nb0 = n0;  // the k tiles A's and B's rows start at (GROUP 2; B's with GROUP 1 and TB),
                                   // B's first row without TB (GROUP 1: its group's block)
#if GROUP == 1
    {
        int e = 0;  // the last group starting at or before m0 (empty groups share the next one's offset)
        while (e + 1 < NGROUPS && offs[e + 1] <= m0) e++;
        if (m0 >= offs[e] + counts[e]) return;
#if TB
        kb = e * bstride / BK;
#else
        nb0 += e * bstride;
#endif
    }
#elif GROUP == 2
    int zrows = 0;  // rows of the last k tile past the group's count (zeroed before the products read them)
    {
        const int z = get_group_id(2), e = z / GS, s = z % GS, n = counts[e];
        kbeg = s * kc;
        kend = min((n + BK - 1) / BK * BK, kbeg + kc);
        if (kend > kbeg && kend > n) zrows = kend - n;
        ka = kb = offs[e] / BK;
#if SPLITK
        if (kbeg >= kend) return;
        Cm += ((size_t)s * NGROUPS + e) * M * ldc;
#else
        kend = max(kend, kbeg);  // an empty group: no tile, its C_e alpha * 0 (+ Cm)
        Cm += (size_t)e * cstride;
#endif
    }
#else
    SPLIT_RANGE(kbeg, kend, Kp)
#endif
    const int k0 = kbeg / BK, nk = (kend - kbeg) / BK;
#if WGMMA_EMULATE
    const uint sbase = 0, bars = sbase + STAGES * STAGE_BYTES;  // byte offsets into smem
#else
    const uint sbase = (uint)(size_t)smem, bars = sbase + STAGES * STAGE_BYTES;
#endif
    const uint tile_bytes = FETCH_BYTES(m0, ma, BM, TA) + FETCH_BYTES(nb0, nb, BN, TB);
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f;

#if !WGMMA_EMULATE
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++)
            asm volatile("// @sm90a@ mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s) : "memory");
        asm volatile("// @sm90a@ fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
#if WGMMA_EMULATE
#define ARRIVE_TX(bar, bytes)
#else
#define ARRIVE_TX(bar, bytes)                                                                            \
    asm volatile("// @sm90a@ mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
#define ISSUE_TILE(stage, kt)                                                                            \
    if (tid == 0) {                                                                                      \
        const uint d_ = sbase + (stage) * STAGE_BYTES, bar_ = bars + 8 * (stage);                        \
        ARRIVE_TX(bar_, tile_bytes)                                                                      \
        FETCH(A, d_, ka + k0 + (kt), m0, lda, ma, BM, TA)                                                \
        FETCH(B, d_ + A_BYTES, kb + k0 + (kt), nb0, ldb, nb, BN, TB)                                     \
    }
    for (int s = 0; s < AHEAD && s < nk; s++) ISSUE_TILE(s, s)
    for (int kt = 0; kt < nk; kt++) {
        barrier(CLK_LOCAL_MEM_FENCE);
        // every warpgroup has waited for the wgmma of tile kt-1-PIPE: its stage takes tile kt+AHEAD
        if (kt + AHEAD < nk) ISSUE_TILE((kt + AHEAD) % STAGES, kt + AHEAD)
#if WGMMA_EMULATE
        barrier(CLK_LOCAL_MEM_FENCE);  // work-item 0's copies of tile kt, done when it issued them
#else
        {
            const uint bar = bars + 8 * (kt % STAGES), phase = (kt / STAGES) & 1;
            uint done = 0;
            while (!done)
                asm volatile("// @sm90a@ { .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                             "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
        }
#endif
        const uint s = sbase + (kt % STAGES) * STAGE_BYTES;
#if GROUP == 2
        if (kt == nk - 1 && zrows) {
            // rows 64 - zrows .. 63 of each 64-column block of the A and B tiles (back to back, 128 bytes a row)
            const int per = zrows * 8;  // 16-byte stores a block
            for (int i = tid; i < (BM + BN) / 64 * per; i += NT)
                st_local4(s + (i / per) * 8192 + (64 - zrows) * 128 + (i % per) * 16, (float4)(0.0f));
            // the products read local memory through the async proxy: order these stores before them
#if !WGMMA_EMULATE
            asm volatile("// @sm90a@ fence.proxy.async.shared::cta;" ::: "memory");
#endif
            barrier(CLK_LOCAL_MEM_FENCE);
        }
#endif
#if WGMMA_EMULATE
        {
            const int g = lane >> 2, t = lane & 3;
            for (int j = 0; j < BN / 8; j++)
                for (int i = 0; i < 4; i++) {
                    const int r = wg * 64 + warp * 16 + g + 8 * (i >> 1), c = 8 * j + 2 * t + (i & 1);
                    float sum = 0.0f;
                    for (int k = 0; k < BK; k++) sum += TILE_AT(s, r, k, TA) * TILE_AT(s + A_BYTES, c, k, TB);
                    acc[4 * j + i] += sum;
                }
        }
#else
        const ulong da = wgmma_desc(s + wg * 64 * 128, TA ? MN_LBO : 16), db = wgmma_desc(s + A_BYTES, TB ? MN_LBO : 16);
        asm volatile(WGMMA_TILE_ASM : WGMMA_ACC_OPERANDS
                     : "l"(da), "l"(db), "r"(1), "l"((ulong)(TA ? KSTEP_MN : KSTEP_K)),
                       "l"((ulong)(TB ? KSTEP_MN : KSTEP_K)), "n"(PIPE) : "memory");
#endif
    }
#if PIPE && !WGMMA_EMULATE
    asm volatile(WGMMA_WAIT0_ASM : WGMMA_ACC_OPERANDS :: "memory");
#endif

#if STAGE_OUT
    // outputs through local memory (the stages are free once every warpgroup's products are done): the
    // fragments go in as rows SO floats apart, then each work-item takes columns 4c4..4c4+3 of rows r0, r0 + RPP,
    // ..., the loads the epilogue needs (R, Cm with ACCUM, E with EPI 2) for OB rows issued before their stores
    barrier(CLK_LOCAL_MEM_FENCE);
    {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                st_local2(sbase + 4 * ((wg * 64 + warp * 16 + g + 8 * h) * SO + 8 * j + 2 * t), acc[4 * j + 2 * h],
                          acc[4 * j + 2 * h + 1]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const int c4 = tid % (BN / 4), r0 = tid / (BN / 4), gn = n0 + 4 * c4;
    // four columns inside N, 16-byte aligned (EPI 3: up's too, ldc / 2 columns on)
    const int full = (ldc & (EPI == 3 ? 7 : 3)) == 0 && gn + 3 < N;
    float4 b4 = 0.0f;
#if BIAS && !SPLITK
    if (full) b4 = *(__global const float4*)(bias + gn);
#endif
    for (int p0 = 0; p0 < BM; p0 += RPP * OB) {
        float4 r4[OB], c4v[OB], e4[OB];
#if EPI == 3
        float4 u4[OB];
#endif
#pragma unroll
        for (int b = 0; b < OB; b++) {
            const int row = p0 + b * RPP + r0, gm = m0 + row;
            const size_t o = (size_t)gm * ldc + gn;
            r4[b] = c4v[b] = e4[b] = 0.0f;
#if EPI == 3
            u4[b] = 0.0f;
#endif
            if (!full || gm >= M || (PART_ROWS && (r0 >= RPP || row >= BM))) continue;
#if RESID && !SPLITK
            r4[b] = *(__global const float4*)(R + o);
#endif
#if ACCUM && !SPLITK
            c4v[b] = *(__global const float4*)(Cm + o);
#endif
#if (EPI == 2 || EPI == 3) && !SPLITK
            e4[b] = *(__global const float4*)(E + o);
#endif
#if EPI == 3 && !SPLITK
            u4[b] = *(__global const float4*)(E + o + ldc / 2);
#endif
        }
#pragma unroll
        for (int b = 0; b < OB; b++) {
            const int row = p0 + b * RPP + r0, gm = m0 + row;
            if (gm >= M || gn >= N || (PART_ROWS && (r0 >= RPP || row >= BM))) continue;
            const float4 v = ld_local4(sbase + 4 * (row * SO + 4 * c4));
            const size_t o = (size_t)gm * ldc + gn;
            if (full) {
#if SPLITK
                *(__global float4*)(Cm + o) = v;
#else
#if EPI == 3  // as epilogue's, lane by lane: c is dact, e4 gate, u4 up
                const float4 d = epilogue4(v, b4, r4[b], c4v[b], e4[b], alpha), g = e4[b];
                const float4 sg = 1.0f / (1.0f + exp(-g));
#if TILED_OUT
                tiled_store4(O16, gm, gn + ldc / 2, M, d * g * sg);
#else
                *(__global float4*)(Cm + o + ldc / 2) = d * g * sg;
#endif
                const float4 c = d * u4[b] * sg * (1.0f + g * (1.0f - sg));
#else
                const float4 c = epilogue4(v, b4, r4[b], c4v[b], e4[b], alpha);
#endif
#if EPI == 1
                const float4 gv = (float4)(gelu_f(c.x), gelu_f(c.y), gelu_f(c.z), gelu_f(c.w));
#if TILED_OUT
                tiled_store4(O16, gm, gn, M, gv);
#else
                *(__global float4*)(E + o) = gv;
#endif
#endif
#if TILED_OUT == 2
                tiled_store4(O16, gm, gn, M, c);
                st_local4(sbase + 4 * (row * SO + 4 * c4), c);  // for the column sums below
#elif TILED_OUT == 3
                tiled_store4(O16, gm, gn, M, c);
#elif OUT_BF16 == 1
                ((__global uint2*)Cm)[o >> 2] = (uint2)(bf16x2(c.x, c.y), bf16x2(c.z, c.w));
#else
#if OUT_BF16 >= 2
                O16[(at16 + o) >> 2] = (uint2)(bf16x2(c.x, c.y), bf16x2(c.z, c.w));
#endif
#if OUT_BF16 != 3
                *(__global float4*)(Cm + o) = c;
#endif
#endif
#endif
            } else {
                const float vv[4] = {v.x, v.y, v.z, v.w};
                for (int i = 0; i < 4 && gn + i < N; i++)
#if SPLITK
                    Cm[o + i] = vv[i];
#elif OUT_BF16 == 1
                    ((__global ushort*)Cm)[o + i] = (ushort)bf16_bits(epilogue(vv[i], gm, gn + i, ldc, Cm, bias, R, E,
                                                                             alpha));
#else
                {
                    const float y = epilogue(vv[i], gm, gn + i, ldc, Cm, bias, R, E, alpha);
#if OUT_BF16 != 3
                    Cm[o + i] = y;
#endif
#if OUT_BF16 >= 2
                    ((__global ushort*)O16)[at16 + o + i] = (ushort)bf16_bits(y);
#endif
                }
#endif
            }
        }
    }
#if TILED_OUT == 2
    // the column sums of each 64 rows (M, N multiples of 64: every quad was whole), one column a work-item
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = tid; i < BN * (BM / 64); i += NT) {
        const int col = i % BN, blk = i / BN;
        if (m0 + 64 * blk >= M || n0 + col >= N) continue;
        float s = 0.0f;
        for (int r = 0; r < 64; r++) s += ld_local(sbase + 4 * ((64 * blk + r) * SO + col));
        part[(size_t)((m0 >> 6) + blk) * N + n0 + col] = s;
    }
#endif
#else
    // outputs: float2 pairs where ldc is even (epilogue.cl store_pair, as matmul_bf16.cl)
    const int g = lane >> 2, t = lane & 3, pairs = (ldc & 1) == 0;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int gn = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int gm = m0 + wg * 64 + warp * 16 + g + 8 * h;
            if (gm >= M || gn >= N) continue;
            const float2 v = (float2)(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            store_pair(v, gm, gn, N, ldc, pairs, Cm, bias, R, E, alpha);
        }
    }
#endif
}

// bf16 GEMM on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a), fp32 sums:
//   C (M,N) fp32 = A (M,K) @ B (N,K)^T, A and B bf16 (ushort) with k-contiguous rows (lda = ldb = K),
//   M % BM == N % BN == K % BK == 0 (the callers' copies are padded with zeros).
// NVIDIA's OpenCL compiles for `.target sm_90`, where wgmma does not exist, so each wgmma line here is a PTX
// comment "// @sm90a@ ..." that names its operands (%0.. as inline asm does; the compiler fills in the
// registers); clgpt/sm90a.py retargets the program's PTX to sm_90a, drops the comment marks and builds the
// PTX as the program binary (bench/probe_sm90a.py is the 64x16x8 proof).
//
// Work-group: 2 warpgroups (256 work-items), output tile BM = 128 rows x BN columns; warpgroup w owns rows
// 64w..64w+63 with BN/2 fp32 accumulators a work-item (wgmma m64nBNk16 D fragment: warp q of the group
// holds rows 16q + g and 16q + g + 8, g = lane / 4, columns 8j + 2t, 8j + 2t + 1, t = lane % 4, for j < BN/8:
// acc[4j..4j+3] = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)).
// K in tiles of BK = 32 bf16, STAGES tiles in flight through cp.async (16-byte copies); both operands sit in
// local memory in wgmma's no-swizzle K-major layout: "core matrices" of 8 rows x 16 bytes (128 contiguous
// bytes), the BK/8 core matrices of an 8-row group side by side (LBO = 128 bytes from one k core matrix to
// the next), 8-row groups SBO = BK/8 * 128 bytes apart. A descriptor holds start >> 4, LBO >> 4, SBO >> 4.
// One tile: fence.proxy.async (cp.async wrote through the generic proxy, wgmma reads through the async one),
// a barrier, the next tile's copies, then BK/16 wgmma and a wait for them.
#ifndef BN
#define BN 128
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef BM
#define BM 128                         // 64 rows a warpgroup: 128 or 256
#endif
#ifndef PIPE
#define PIPE 0                         // 1: a tile's wgmma stays in flight while the next one issues
#endif
#ifndef BULK
#define BULK 0                         // 1: pre-tiled operands, one bulk copy an operand a stage (mbarriers)
#endif
#define AHEAD (STAGES - 1 - PIPE)      // tiles in flight ahead of the one multiplied
#ifndef NOLOAD
#define NOLOAD 0                       // bench only: no loads after the first tiles (the wgmma rate alone)
#endif
#define NT (2 * BM)                    // work-items: BM / 64 warpgroups of 128
#ifndef BK
#define BK 32                          // 32 or 64
#endif
#define KCH (BK / 8)                   // 16-byte chunks a row of a tile
#define SBO (KCH * 128)                // bytes from one 8-row group of core matrices to the next
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NACC (BN / 2)
#define SMEM_DECL (SMEM_NEED < 49152 ? SMEM_NEED : 49152)
#define SMEM_NEED (STAGES * STAGE_BYTES + 64 * BULK)  // BULK: the stages' mbarriers after the tiles
#if SMEM_NEED > 49152 && SMEM_BYTES != SMEM_NEED
#error SMEM_BYTES must be STAGES * (BM + BN) * BK * 2 (+ 64 with BULK): the size clgpt/sm90a.py gives the local array in the PTX
#endif

inline ulong wgmma_desc(const uint addr)
{
    return (ulong)((addr & 0x3FFFF) >> 4) | ((ulong)(128 >> 4) << 16) | ((ulong)(SBO >> 4) << 32);
}

inline void cp_async16(const uint dst, __global const ushort* src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// WGMMA_TILE_ASM: BK/16 wgmma m64nBNk16 over one tile (k + 16 = descriptor start + 256 bytes >> 4), then a
// wait until none (PIPE 0) or one (PIPE 1) group is pending; operands: the BN/2 accumulators, A's and B's
// descriptors, 1 (scale-d: accumulate).
#if BN == 128 && BK == 32
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %66, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %64, 0; add.s64 db, %65, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 16; add.s64 db, %65, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 0; }\n"
#define WGMMA_TILE_ASM_PIPE \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %66, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %64, 0; add.s64 db, %65, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 16; add.s64 db, %65, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 1; }\n"
#elif BN == 128 && BK == 64
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %66, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %64, 0; add.s64 db, %65, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 16; add.s64 db, %65, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 32; add.s64 db, %65, 32;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 48; add.s64 db, %65, 48;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 0; }\n"
#define WGMMA_TILE_ASM_PIPE \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %66, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %64, 0; add.s64 db, %65, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 16; add.s64 db, %65, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 32; add.s64 db, %65, 32;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %64, 48; add.s64 db, %65, 48;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 1; }\n"
#elif BN == 256 && BK == 32
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %130, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %128, 0; add.s64 db, %129, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 16; add.s64 db, %129, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 0; }\n"
#define WGMMA_TILE_ASM_PIPE \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %130, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %128, 0; add.s64 db, %129, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 16; add.s64 db, %129, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 1; }\n"
#elif BN == 256 && BK == 64
#define WGMMA_TILE_ASM \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %130, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %128, 0; add.s64 db, %129, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 16; add.s64 db, %129, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 32; add.s64 db, %129, 32;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 48; add.s64 db, %129, 48;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 0; }\n"
#define WGMMA_TILE_ASM_PIPE \
    "// @sm90a@ { .reg .pred p; .reg .b64 da, db;\n" \
    "// @sm90a@ setp.ne.b32 p, %130, 0;\n" \
    "// @sm90a@ wgmma.fence.sync.aligned;\n" \
    "// @sm90a@ add.s64 da, %128, 0; add.s64 db, %129, 0;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 16; add.s64 db, %129, 16;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 32; add.s64 db, %129, 32;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ add.s64 da, %128, 48; add.s64 db, %129, 48;\n" \
    "// @sm90a@ wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, da, db, p, 1, 1, 0, 0;\n" \
    "// @sm90a@ wgmma.commit_group.sync.aligned;\n" \
    "// @sm90a@ wgmma.wait_group.sync.aligned 1; }\n"
#else
#error BN is 128 or 256, BK 32 or 64
#endif
#if BN == 128
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63])
#elif BN == 256
#define WGMMA_ACC_OPERANDS "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63]), "+f"(acc[64]), "+f"(acc[65]), "+f"(acc[66]), "+f"(acc[67]), "+f"(acc[68]), "+f"(acc[69]), "+f"(acc[70]), "+f"(acc[71]), "+f"(acc[72]), "+f"(acc[73]), "+f"(acc[74]), "+f"(acc[75]), "+f"(acc[76]), "+f"(acc[77]), "+f"(acc[78]), "+f"(acc[79]), "+f"(acc[80]), "+f"(acc[81]), "+f"(acc[82]), "+f"(acc[83]), "+f"(acc[84]), "+f"(acc[85]), "+f"(acc[86]), "+f"(acc[87]), "+f"(acc[88]), "+f"(acc[89]), "+f"(acc[90]), "+f"(acc[91]), "+f"(acc[92]), "+f"(acc[93]), "+f"(acc[94]), "+f"(acc[95]), "+f"(acc[96]), "+f"(acc[97]), "+f"(acc[98]), "+f"(acc[99]), "+f"(acc[100]), "+f"(acc[101]), "+f"(acc[102]), "+f"(acc[103]), "+f"(acc[104]), "+f"(acc[105]), "+f"(acc[106]), "+f"(acc[107]), "+f"(acc[108]), "+f"(acc[109]), "+f"(acc[110]), "+f"(acc[111]), "+f"(acc[112]), "+f"(acc[113]), "+f"(acc[114]), "+f"(acc[115]), "+f"(acc[116]), "+f"(acc[117]), "+f"(acc[118]), "+f"(acc[119]), "+f"(acc[120]), "+f"(acc[121]), "+f"(acc[122]), "+f"(acc[123]), "+f"(acc[124]), "+f"(acc[125]), "+f"(acc[126]), "+f"(acc[127])
#endif
#define WGMMA_WAIT0_ASM "// @sm90a@ wgmma.wait_group.sync.aligned 0;\n"

// Chunk c of a tile (16 bytes) is row 8 (c / (8 KCH)) + c % 8, k chunk (c / 8) % KCH: local offset 16 c in the
// core-matrix layout, so the 32 copies of a warp fill 512 contiguous bytes (no bank conflicts; with
// consecutive k chunks a work-item, 8 copies of a warp would share their banks).
#define TILE_ROW(c) ((((c) / (8 * KCH)) << 3) + ((c) & 7))
#define TILE_K(c) (8 * (((c) >> 3) % KCH))
#define LOAD_TILE(stage, kt)                                                                            \
    {                                                                                                   \
        const uint s_ = sbase + (stage) * STAGE_BYTES;                                                  \
        const int k_ = (kt) * BK;                                                                       \
        for (int c = tid; c < BM * KCH; c += NT)                                                        \
            cp_async16(s_ + 16 * c, A + (size_t)(m0 + TILE_ROW(c)) * K + k_ + TILE_K(c));               \
        for (int c = tid; c < BN * KCH; c += NT)                                                        \
            cp_async16(s_ + A_BYTES + 16 * c, B + (size_t)(n0 + TILE_ROW(c)) * K + k_ + TILE_K(c));     \
    }

#if BULK
// Operands pre-tiled (BULK 1): A as K/BK x M/8 blocks of 8 rows x BK, each in the local layout above (1 KB for
// BK 64), so rows m0..m0+BM-1 of k tile kt are one contiguous BM*BK*2 bytes: one bulk copy (the copy engine
// that TMA uses, without a tensor map) a operand a stage, completing the stage's mbarrier. B likewise.
#define ISSUE_TILE(stage, kt)                                                                           \
    if (tid == 0) {                                                                                     \
        const uint d_ = sbase + (stage) * STAGE_BYTES, bar_ = bars + 8 * (stage);                       \
        asm volatile("// @sm90a@ mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"               \
                     ::"r"(bar_), "r"(STAGE_BYTES) : "memory");                                         \
        asm volatile("// @sm90a@ cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "    \
                     "[%0], [%1], %2, [%3];" ::"r"(d_), "l"(A + ((size_t)(kt) * (M / 8) + m0 / 8) * 8 * BK), \
                     "r"(A_BYTES), "r"(bar_) : "memory");                                               \
        asm volatile("// @sm90a@ cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "    \
                     "[%0], [%1], %2, [%3];" ::"r"(d_ + A_BYTES), "l"(B + ((size_t)(kt) * (N / 8) + n0 / 8) * 8 * BK), \
                     "r"(B_BYTES), "r"(bar_) : "memory");                                               \
    }
#define COMMIT_TILE()
#else
#define ISSUE_TILE(stage, kt) LOAD_TILE(stage, kt)
#define COMMIT_TILE() asm volatile("cp.async.commit_group;" ::: "memory")  // also when empty: wait_group counts
#endif

__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void matmul_wgmma(const int M, const int N, const int K,
                  __global const ushort* restrict A, __global const ushort* restrict B, __global float* C)
{
    // declared at most 48 KB, the most NVIDIA's OpenCL lets a work-group have; clgpt/sm90a.py raises the PTX
    // array to SMEM_BYTES = STAGES * STAGE_BYTES (Hopper grants up to 227 KB; nothing here indexes it from C)
    __local uint4 smem[SMEM_DECL / 16];
    const int tid = get_local_id(0), wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int n0 = get_group_id(0) * BN, m0 = get_group_id(1) * BM;
    const uint sbase = (uint)(size_t)smem;
    const int nk = K / BK;
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f;

#if BULK
    // one mbarrier a stage, after the tiles: thread 0 arms it with the stage's byte count and starts the two
    // bulk copies, which complete it; every work-item waits for its phase (tile kt uses phase (kt / STAGES) & 1)
    const uint bars = sbase + STAGES * STAGE_BYTES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++)
            asm volatile("// @sm90a@ mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s) : "memory");
        asm volatile("// @sm90a@ fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
    for (int s = 0; s < AHEAD; s++) {
        if (s < nk) ISSUE_TILE(s, s)
        COMMIT_TILE();
    }
    for (int kt = 0; kt < nk; kt++) {
#if !BULK
        asm volatile("cp.async.wait_group %0;" ::"n"(AHEAD - 1) : "memory");  // tile kt landed (this work-item's part)
        asm volatile("// @sm90a@ fence.proxy.async.shared::cta;" ::: "memory");  // cp.async wrote as generic proxy
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        // every warpgroup has waited for the wgmma of tile kt-1-PIPE: its stage takes tile kt+AHEAD
        if (!NOLOAD && kt + AHEAD < nk) ISSUE_TILE((kt + AHEAD) % STAGES, kt + AHEAD)
        COMMIT_TILE();
#if BULK
        {
            const uint bar = bars + 8 * (kt % STAGES), phase = (kt / STAGES) & 1;
            uint done = 0;
            while (!done)
                asm volatile("// @sm90a@ { .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                             "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
        }
#endif
        const uint s = sbase + (kt % STAGES) * STAGE_BYTES;
        const ulong da = wgmma_desc(s + wg * (64 / 8) * SBO), db = wgmma_desc(s + A_BYTES);
#if PIPE
        asm volatile(WGMMA_TILE_ASM_PIPE : WGMMA_ACC_OPERANDS : "l"(da), "l"(db), "r"(1) : "memory");
#else
        asm volatile(WGMMA_TILE_ASM : WGMMA_ACC_OPERANDS : "l"(da), "l"(db), "r"(1) : "memory");
#endif
    }
#if PIPE
    asm volatile(WGMMA_WAIT0_ASM : WGMMA_ACC_OPERANDS :: "memory");
#endif
    const int g = lane >> 2, t = lane & 3, r = m0 + wg * 64 + warp * 16 + g;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int col = n0 + 8 * j + 2 * t;
        vstore2((float2)(acc[4 * j], acc[4 * j + 1]), 0, C + (size_t)r * N + col);
        vstore2((float2)(acc[4 * j + 2], acc[4 * j + 3]), 0, C + (size_t)(r + 8) * N + col);
    }
}

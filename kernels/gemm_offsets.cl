// A GEMM work-group's operand and output offsets, #included inside the body of matmul.cl's `matmul` and
// matmul_mma.cl's (one contract, see matmul.cl): GROUP 1 finds the row tile's group and its B_e, GROUP 2 the
// group's K range and C_e (or split-K chunk), SPLITK the chunk, BATCH the (batch, head) slice. Reads m0 (the
// tile's first row), M, K, A, lda, B, ldb, Cm, ldc and the kernel's EXTRA_ARGS; declares kbeg, kend (the K range
// summed) and mend (rows m < mend of the output exist); may return for a work-group with nothing to do.
    int kbeg = 0, kend = K, mend = M;  // rows m < mend of the output exist (GROUP 1: the group's)
#if defined(GROUP) && GROUP == 1
    {
        int e = 0;  // the last group starting at or before m0 (empty groups share the next one's offset)
        while (e + 1 < NGROUPS && offs[e + 1] <= m0) e++;
        mend = offs[e] + counts[e];
        if (m0 >= mend) return;  // padding between groups, or past the last: the whole work-group leaves
        B += (size_t)e * bstride;
    }
#elif defined(GROUP)
    {
        const int z = get_group_id(2), e = z / GS, s = z % GS;
        kbeg = s * kc;
        kend = min(counts[e], kbeg + kc);
#if TA == 0
        A += offs[e];
#else
        A += (size_t)offs[e] * lda;
#endif
#if TB == 0
        B += (size_t)offs[e] * ldb;
#else
        B += offs[e];
#endif
#if SPLITK
        if (kbeg >= kend) return;
        Cm += ((size_t)s * NGROUPS + e) * M * ldc;
#else
        Cm += (size_t)e * cstride;
#endif
    }
#elif SPLITK
    {
        const int z = get_group_id(2);
        kbeg = z * kc;
        kend = min(K, kbeg + kc);
        Cm += (size_t)z * M * ldc;
    }
#endif
#if BATCH
    {
        const int z = get_group_id(2), zb = z / HB, zh = z % HB;
        A += oA + (size_t)zb * sAb + zh * sAh;
        B += oB + (size_t)zb * sBb + zh * sBh;
        Cm += oC + (size_t)zb * sCb + zh * sCh;
    }
#endif

// Dropout with counter-based masks: element i of site `site` is kept when u(seed, site, i) >= p, where
//   k = fmix32(seed ^ (site * 0x85EBCA6B + 0x27D4EB2F)),  h = fmix32(k ^ fmix32(i)),  u = (h >> 8) / 2^24
// (fmix32: MurmurHash3's finaliser). Nothing is stored: the backward regenerates the mask from (seed, site, i),
// so a run is bit-identical whatever the launch order, and clgpt/models/dropout.py computes the same mask in numpy.
//   forward:   out = keep ? x / (1 - p) : 0
//   residual:  out = resid + (keep ? y / (1 - p) : 0)
//   backward:  out = keep ? dx / (1 - p) : 0
// One work-item per element; n elements, i in [0, n).

inline uint fmix32(uint h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

inline int dropout_keep(const uint seed, const uint site, const uint i, const float p)
{
    const uint k = fmix32(seed ^ (site * 0x85EBCA6Bu + 0x27D4EB2Fu));
    const uint h = fmix32(k ^ fmix32(i));
    return (float)(h >> 8) * (1.0f / 16777216.0f) >= p;
}

__kernel void dropout_forward(const int n, const uint seed, const uint site, const float p,
                              __global const float* x, __global float* out)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    out[i] = dropout_keep(seed, site, (uint)i, p) ? x[i] * (1.0f / (1.0f - p)) : 0.0f;
}

__kernel void dropout_residual(const int n, const uint seed, const uint site, const float p,
                               __global const float* resid, __global const float* y, __global float* out)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    out[i] = resid[i] + (dropout_keep(seed, site, (uint)i, p) ? y[i] * (1.0f / (1.0f - p)) : 0.0f);
}

__kernel void dropout_backward(const int n, const uint seed, const uint site, const float p,
                               __global const float* dx, __global float* out)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    out[i] = dropout_keep(seed, site, (uint)i, p) ? dx[i] * (1.0f / (1.0f - p)) : 0.0f;
}

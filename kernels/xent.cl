// Fused softmax + cross-entropy with a per-token loss mask.  -D: V
// logits (N,V), targets (N) int, mask (N).
//   forward:  lse[n] = log sum_v exp(logits[n,v]);  losses[n] = mask[n] * (lse[n] - logits[n,target])
//             (the host sums losses in order and divides by sum(mask))
//   backward: dlogits[n,v] = s * mask[n] * (exp(logits[n,v] - lse[n]) - [v == target]),  s = scale / sum(mask)
#ifndef V
#error "V must be defined"
#endif

__kernel void xent_forward(const int N, __global const float* logits, __global const int* targets,
                           __global const float* mask, __global float* losses, __global float* lse)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    __global const float* l = logits + (size_t)n * V;
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = fmax(mx, l[v]);
    float s = 0.0f;
    for (int v = 0; v < V; v++) s += exp(l[v] - mx);
    const float z = mx + log(s);
    lse[n] = z;
    const int tgt = targets[n];
    const float mk = mask[n];
    losses[n] = (mk != 0.0f && tgt >= 0 && tgt < V) ? mk * (z - l[tgt]) : 0.0f;
}

__kernel void xent_backward(const int N, const float s, __global const float* logits,
                            __global const int* targets, __global const float* mask,
                            __global const float* lse, __global float* dlogits)
{
    const int v = get_global_id(0), n = get_global_id(1);
    if (v >= V || n >= N) return;
    const size_t i = (size_t)n * V + v;
    const float p = exp(logits[i] - lse[n]);
    dlogits[i] = s * mask[n] * (p - (v == targets[n] ? 1.0f : 0.0f));
}

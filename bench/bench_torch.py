"""PyTorch peer of `clgpt bench`: the same GPT-2 or llama trained on random tokens, eager fp32.

    python bench/bench_torch.py [--arch gpt2|llama] [--kv-heads N] [--experts E --experts-used K]
                                [--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8]
                                [--steps 20] [--warmup 3] [--gemm 1024] [--device cpu|cuda] [--threads N]
                                [--attention sdpa|written] [--nanogpt]   (--nanogpt: torch.compile + bf16 autocast + fused AdamW, as nanoGPT on a GPU)

Same architectures as clgpt (ARCHITECTURE.md), as users run them in PyTorch (nanoGPT): attention through
F.scaled_dot_product_attention (causal), AdamW fused on CUDA and foreach on CPU (betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on matrices only, as clgpt), global gradient clipping to 1.0, float32, eager mode (no
torch.compile), default intra-op threads (all cores).
- gpt2: learned positions, pre-LayerNorm blocks (eps 1e-5), GELU (tanh form), final LayerNorm, tied head.
- llama: RMSNorm (eps 1e-5), RoPE on adjacent pairs (base 10000), grouped-query attention (--kv-heads),
  SwiGLU, no biases, final RMSNorm, tied head; --experts E --experts-used K: a mixture of experts with a
  softmax router and top-k renormalised weights, each expert run on its tokens (index_select/index_add_).
--attention written: the extra, labelled option of a written-out masked softmax of q @ k.T (like clgpt's
kernels) instead of SDPA.

PyTorch is not a dependency of clgpt: it is imported here only. The last line is `tokens/s=<number>`.
"""

from __future__ import annotations

import argparse
import math
import time


def attention(torch, q, k, v, causal, written):
    """Causal attention of (B,H,T,D) q, k, v: SDPA, or written out (the labelled extra option)."""
    if not written:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    Tp = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    att = att.masked_fill(~causal[:Tp, :Tp], float("-inf")).softmax(dim=-1)
    return att @ v


def build_llama(torch, V, T, C, F, H, Hkv, L, E, K, written):
    nn = torch.nn
    Fn = torch.nn.functional
    D = C // H

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * theta[None]
    cos, sin = ang.cos().float(), ang.sin().float()  # (T, D/2)

    def rope(x, Tp):  # x (B, h, T, D): adjacent pairs (2i, 2i+1) rotated (llama.cpp's normal rope)
        x2 = x.view(*x.shape[:-1], D // 2, 2)
        c, s = cos[:Tp].to(x.device), sin[:Tp].to(x.device)
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(C, F, bias=False)
            self.up = nn.Linear(C, F, bias=False)
            self.down = nn.Linear(F, C, bias=False)

        def forward(self, x):
            return self.down(Fn.silu(self.gate(x)) * self.up(x))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(C, E, bias=False)
            self.experts = nn.ModuleList(SwiGLU() for _ in range(E))

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, C)
            p = self.router(x).softmax(-1)
            w, sel = p.topk(K, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = (sel == e).nonzero(as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, expert(x.index_select(0, tok)) * w[tok, slot, None])
            return out.view(shape)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = RMSNorm()
            self.q = nn.Linear(C, C, bias=False)
            self.k = nn.Linear(C, Hkv * D, bias=False)
            self.v = nn.Linear(C, Hkv * D, bias=False)
            self.proj = nn.Linear(C, C, bias=False)
            self.ln2 = RMSNorm()
            self.ffn = MoE() if E else SwiGLU()
            self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False)

        def forward(self, x):
            B, Tp, _ = x.shape
            h = self.ln1(x)
            q = rope(self.q(h).view(B, Tp, H, D).transpose(1, 2), Tp)
            k = rope(self.k(h).view(B, Tp, Hkv, D).transpose(1, 2), Tp)
            v = self.v(h).view(B, Tp, Hkv, D).transpose(1, 2)
            if Hkv != H:  # grouped-query attention: each kv head serves H/Hkv query heads
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            y = attention(torch, q, k, v, self.causal, written).transpose(1, 2).contiguous().view(B, Tp, C)
            x = x + self.proj(y)
            return x + self.ffn(self.ln2(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = RMSNorm()
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            x = self.wte(idx)
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied head
            return Fn.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    return Llama()


def build_model(torch, V, T, C, F, H, L, written=False):
    nn = torch.nn
    Fn = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.ln2 = nn.LayerNorm(C, eps=1e-5)
            self.up = nn.Linear(C, F)
            self.down = nn.Linear(F, C)
            self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False)

        def forward(self, x):
            B, Tp, _ = x.shape
            D = C // H
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q = q.view(B, Tp, H, D).transpose(1, 2)
            k = k.view(B, Tp, H, D).transpose(1, 2)
            v = v.view(B, Tp, H, D).transpose(1, 2)
            y = attention(torch, q, k, v, self.causal, written).transpose(1, 2).contiguous().view(B, Tp, C)
            x = x + self.proj(y)
            return x + self.down(Fn.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            # GPT-2 initialisation, as clgpt.model.init_params
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            B, Tp = idx.shape
            x = self.wte(idx) + self.wpe(torch.arange(Tp, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied head
            return Fn.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    return GPT()


def gemm_gflops(torch, n: int, device: str, sync) -> tuple[float, float]:
    """-> (GFLOP/s of the best of a few timed C = A @ B at n x n float32, max rel err vs float64)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=torch.float32).to(device)
    b = torch.randn(n, n, generator=g, dtype=torch.float32).to(device)
    c = a @ b
    sync()
    ref = a.double() @ b.double()
    err = float(((c.double() - ref).abs().max() / ref.abs().max()).item())
    reps = 1
    while True:  # grow the repetition count until one timing takes >= 0.2 s
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            c = a @ b
        sync()
        dt = time.perf_counter() - t0
        if dt >= 0.2 or reps >= 1 << 16:
            break
        reps *= 4
    best = dt / reps
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            c = a @ b
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * n**3 / best / 1e9, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=80)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0 = --heads)")
    ap.add_argument("--experts", type=int, default=0, help="llama: experts per feed-forward (0 = dense)")
    ap.add_argument("--experts-used", type=int, default=0, help="llama: experts each token routes to")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "written"],
                    help="sdpa (F.scaled_dot_product_attention, what users run) or written (extra option: "
                         "masked softmax of q @ k.T written out)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--gemm", type=int, default=0, help="square GEMM size for torch matmul GFLOP/s (0 = skip)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nanogpt", action="store_true",
                    help="as nanoGPT trains on a GPU: torch.compile, bf16 autocast, SDPA attention, fused AdamW")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, the N kernels with the most device time a step (torch.profiler, 3 steps)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        # fp32 means fp32: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        sync = torch.cuda.synchronize
        dev_name = torch.cuda.get_device_name(dev)
    else:
        sync = lambda: None  # noqa: E731
        import platform

        dev_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(args.seed)

    V, T, C, F, H, L, B = args.vocab, args.ctx, args.embd, args.ffn, args.heads, args.layers, args.batch
    written = args.attention == "written"
    if args.arch == "llama":
        Hkv = args.kv_heads or H
        model = build_llama(torch, V, T, C, F, H, Hkv, L, args.experts, args.experts_used, written).to(dev)
    else:
        model = build_model(torch, V, T, C, F, H, L, written).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
        **({"fused": True} if dev.type == "cuda" or args.nanogpt else {"foreach": True}),
    )
    fwd = torch.compile(model) if args.nanogpt else model
    import contextlib

    autocast = (lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16)) if args.nanogpt else contextlib.nullcontext
    rng = np.random.default_rng(args.seed)

    def batch():
        x = rng.integers(0, V, size=(B, T + 1), dtype=np.int64)
        return (torch.from_numpy(np.ascontiguousarray(x[:, :-1])).to(dev),
                torch.from_numpy(np.ascontiguousarray(x[:, 1:])).to(dev))

    def train_step():
        xb, yb = batch()
        with autocast():
            loss = fwd(xb, yb)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    print(f"device: torch {torch.__version__} {args.device}: {dev_name}"
          + (" (torch.compile, bf16 autocast, fused AdamW)" if args.nanogpt else ""))
    moe = f" E={args.experts} K={args.experts_used}" if args.arch == "llama" and args.experts else ""
    print(f"model: {args.arch} V={V} T={T} C={C} F={F} H={H}{moe} L={L} B={B}, attention {args.attention}, "
          f"{n_params:,} parameters")
    for _ in range(args.warmup):
        loss = train_step()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = train_step()
    final = float(loss.item())  # syncs
    sync()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    ms = dt / args.steps * 1e3
    tps = B * T * args.steps / dt
    print(f"train: {args.steps} steps after {args.warmup} warmup, loss {final:.4f}, {ms:.2f} ms/step, "
          f"{cpu / args.steps * 1e3:.2f} ms CPU time/step (all threads)")
    if args.gemm > 0:
        gf, err = gemm_gflops(torch, args.gemm, args.device, sync)
        lib = "cuBLAS" if dev.type == "cuda" else "CPU BLAS"
        print(f"gemm {args.gemm}^2 fp32: torch matmul ({lib}) {gf:.1f} GFLOP/s, max rel err {err:.2e}")
    print(f"tokens/s={tps:.1f}")
    if args.profile > 0:
        profile_kernels(torch, train_step, sync, args.profile)
    return 0


def profile_kernels(torch, train_step, sync, top: int, steps: int = 3) -> None:
    """Print the `top` device kernels by time a step over `steps` profiled steps, as clgpt's profile lists its own."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step()
        sync()
    rows = []
    for e in prof.key_averages():  # the kernels: events on the device, each with its own device time
        if e.device_type.name != "CPU" and e.self_device_time_total > 0:
            rows.append((e.self_device_time_total / steps / 1e3, e.count // steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile: {total:.2f} ms of kernels a step, {sum(r[1] for r in rows)} launches")
    for ms, n, name in rows[:top]:
        print(f"  {ms:8.3f} ms {n:5d}x  {name[:110]}")


if __name__ == "__main__":
    raise SystemExit(main())

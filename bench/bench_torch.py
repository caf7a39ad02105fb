"""PyTorch peer of `clgpt bench`: the same GPT-2 trained on random tokens, eager fp32.

    python bench/bench_torch.py [--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8]
                                [--steps 20] [--warmup 3] [--gemm 1024] [--device cpu|cuda] [--threads N]
                                [--nanogpt]   (torch.compile + bf16 autocast + SDPA + fused AdamW, as nanoGPT on a GPU)

Same architecture as clgpt (ARCHITECTURE.md): learned positions, pre-LayerNorm blocks (eps 1e-5), causal
multi-head attention scaled by 1/sqrt(D), GELU (tanh form), a final LayerNorm and a head tied to the
token embedding; AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only, as clgpt), global
gradient clipping to 1.0, float32, eager mode (no torch.compile), default intra-op threads (all cores).
Attention is written out (masked softmax of q @ k.T), like clgpt's kernels, not a fused SDPA.

PyTorch is not a dependency of clgpt: it is imported here only. The last line is `tokens/s=<number>`.
"""

from __future__ import annotations

import argparse
import math
import time


def build_model(torch, V, T, C, F, H, L, sdpa=False):
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
            if sdpa:  # nanoGPT's attention: fused (flash) kernel
                y = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
                att = att.masked_fill(~self.causal[:Tp, :Tp], float("-inf")).softmax(dim=-1)
                y = att @ v
            y = y.transpose(1, 2).contiguous().view(B, Tp, C)
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--gemm", type=int, default=0, help="square GEMM size for torch matmul GFLOP/s (0 = skip)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nanogpt", action="store_true",
                    help="as nanoGPT trains on a GPU: torch.compile, bf16 autocast, SDPA attention, fused AdamW")
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
    model = build_model(torch, V, T, C, F, H, L, sdpa=args.nanogpt).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **(dict(fused=True) if args.nanogpt else dict(foreach=True)),
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
          + (" (torch.compile, bf16 autocast, SDPA, fused AdamW)" if args.nanogpt else ""))
    print(f"model: V={V} T={T} C={C} F={F} H={H} L={L} B={B}, {n_params:,} parameters")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

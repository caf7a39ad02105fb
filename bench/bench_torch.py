"""PyTorch peer of `clgpt bench`: the same GPT-2 or llama trained on random tokens, as users train it in PyTorch.

    python bench/bench_torch.py [--arch gpt2|llama] [--kv-heads N] [--experts E --experts-used K]
                                [--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8]
                                [--steps 20] [--warmup 3] [--gemm 1024] [--device cpu|cuda] [--threads N]
                                [--attention sdpa|written] [--nanogpt [--no-compile]] [--check-minimal ROUNDS]
                                [--serve]

Same architectures as clgpt (ARCHITECTURE.md), as users run them in PyTorch (nanoGPT): attention through
F.scaled_dot_product_attention (causal), AdamW fused on CUDA and foreach on CPU (betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on matrices only, as clgpt), global gradient clipping to 1.0, float32, eager mode (no
torch.compile), default intra-op threads (all cores).
- gpt2: learned positions, pre-LayerNorm blocks (eps 1e-5), GELU (tanh form), final LayerNorm, tied head.
- llama: RMSNorm (F.rms_norm, eps 1e-5), RoPE on adjacent pairs (base 10000; cos/sin tables made once, buffers
  of the model), grouped-query attention (--kv-heads), SwiGLU, no biases, final RMSNorm, tied head;
  --experts E --experts-used K: a mixture of experts with a softmax router and top-k renormalised weights, each
  expert run on its tokens (index_select/index_add_: data-dependent shapes, so the host waits on each routing).
--attention written: the extra, labelled option of a written-out masked softmax of q @ k.T (like clgpt's
kernels) instead of SDPA.

The step is nanoGPT's train.py loop: the batch is windows of a host token array (its np.memmap of train.bin),
copied from pinned memory with non_blocking=True (on CUDA) and fetched for the next step right after the
forward, so the host queues work ahead of the GPU; backward, clipping, AdamW, zero_grad(set_to_none=True).
--data device: the token array resident on the device and the windows gathered there, so a host-bound peer
spends no host time on its data (the issue's "or resident").
--nanogpt: as nanoGPT trains on a GPU: torch.compile of the model, bf16 autocast, TF32 on, fused AdamW
(--no-compile: eager, for a smoke test on a CPU only; a GPU peer always compiles).

Besides wall time a step it prints the CPU time a step (all threads) and the host's time to issue one step
(steps synced one by one): a peer whose issue time is its step time is bound by the host, not the device.
CPU time alone cannot say so on CUDA, whose waits spin.
--check-minimal R: then R alternated rounds of the timed loop and of a minimal nanoGPT-style loop on the same
model and optimizer (tokens drawn on the device each step by torch.randint, forward, backward, clip, step,
zero_grad: no host data, no prefetch), and a check that the peer's step is no slower than the minimal loop's.
--serve: after the warmup, print `ready` and take commands on stdin, one a line, each answered by its lines and
`done`: `train N` (N timed steps, after 3 untimed ones), `check R N` (as --check-minimal R with N steps a round);
end of input ends it (bench/peer_ratio.py alternates it with `clgpt bench` without compiling it again).

PyTorch is not a dependency of clgpt: it is imported here only. The last line is `tokens/s=<number>`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
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
            return Fn.rms_norm(x, (C,), self.weight, eps=1e-5)

    def rope(x, cos, sin):  # x (B, h, T, D), cos/sin (T, D/2): pairs (2i, 2i+1) rotated (llama.cpp's normal rope)
        x2 = x.view(*x.shape[:-1], D // 2, 2)
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

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

        def forward(self, x, cos, sin):
            B, Tp, _ = x.shape
            h = self.ln1(x)
            q = rope(self.q(h).view(B, Tp, H, D).transpose(1, 2), cos, sin)
            k = rope(self.k(h).view(B, Tp, Hkv, D).transpose(1, 2), cos, sin)
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
            # RoPE's tables, made once and moved with the model (buffers): (T, D/2) each
            theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            ang = torch.arange(T, dtype=torch.float64)[:, None] * theta[None]
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            x = self.wte(idx)
            cos, sin = self.cos[:idx.shape[1]], self.sin[:idx.shape[1]]
            for blk in self.blocks:
                x = blk(x, cos, sin)
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


def parse_args(argv=None):
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
    ap.add_argument("--no-compile", action="store_true",
                    help="with --nanogpt on a CPU: no torch.compile (a quick smoke test, not the peer)")
    ap.add_argument("--data", default="host", choices=["host", "device"],
                    help="host: nanoGPT's batches, windows of a host array copied from pinned memory; device: the "
                         "token array resident on the device, windows gathered there (no host work a step)")
    ap.add_argument("--check-minimal", type=int, default=0, metavar="ROUNDS",
                    help="then ROUNDS alternated rounds of the peer and a minimal loop, and the check of the two")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="--check-minimal: how much slower than the minimal loop the peer may read (0.03 = 3%%)")
    ap.add_argument("--serve", action="store_true", help="after the warmup, take `train N` / `check R N` on stdin")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, the N kernels with the most device time a step (torch.profiler, 3 steps)")
    args = ap.parse_args(argv)
    if args.no_compile and args.device != "cpu":
        ap.error("--no-compile is for a smoke test on the CPU; the peer on a GPU is always compiled")
    return args


class Peer:
    """The model, its optimizer and the two training loops: nanoGPT's (`step`) and the minimal one (`minimal_step`)."""

    def __init__(self, torch, args):
        import numpy as np

        self.torch, self.args = torch, args
        dev = self.dev = torch.device(args.device)
        V, T, C, F, H, L, B = args.vocab, args.ctx, args.embd, args.ffn, args.heads, args.layers, args.batch
        written = args.attention == "written"
        if args.arch == "llama":
            Hkv = args.kv_heads or H
            model = build_llama(torch, V, T, C, F, H, Hkv, L, args.experts, args.experts_used, written).to(dev)
        else:
            model = build_model(torch, V, T, C, F, H, L, written).to(dev)
        self.model = model
        self.n_params = sum(p.numel() for p in model.parameters())
        decay = [p for n, p in model.named_parameters() if p.dim() == 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
            **({"fused": True} if dev.type == "cuda" or args.nanogpt else {"foreach": True}),
        )
        self.compiled = args.nanogpt and not args.no_compile
        self.fwd = torch.compile(model) if self.compiled else model
        self.bf16 = args.nanogpt
        # nanoGPT's data: a flat uint16 token array on the host (its np.memmap of train.bin), random windows of it
        n = max(1 << 20, 4 * B * (T + 1))
        self.data = np.random.default_rng(args.seed).integers(0, V, size=n, dtype=np.uint16)
        self.gen = torch.Generator().manual_seed(args.seed)
        if args.data == "device":
            self.data_dev = torch.from_numpy(self.data.astype(np.int64)).to(dev)
            self.window = torch.arange(args.ctx, device=dev)
        self.next = self.get_batch()

    def autocast(self):
        import contextlib

        if not self.bf16:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.dev.type, dtype=self.torch.bfloat16)

    def get_batch(self):
        """nanoGPT's get_batch: B windows of T+1 tokens at random offsets, pinned and copied without waiting; with
        --data device, gathered from the resident token array on the device."""
        torch, np, T, B = self.torch, __import__("numpy"), self.args.ctx, self.args.batch
        if self.args.data == "device":
            ix = torch.randint(len(self.data) - T, (B, 1), device=self.dev) + self.window
            return self.data_dev[ix], self.data_dev[ix + 1]
        ix = torch.randint(len(self.data) - T, (B,), generator=self.gen)
        x = torch.stack([torch.from_numpy(self.data[i:i + T].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(self.data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
        if self.dev.type == "cuda":
            return x.pin_memory().to(self.dev, non_blocking=True), y.pin_memory().to(self.dev, non_blocking=True)
        return x.to(self.dev), y.to(self.dev)

    def step(self):
        """One step of nanoGPT's loop; the next batch is fetched while the device runs this one's forward."""
        x, y = self.next
        with self.autocast():
            loss = self.fwd(x, y)
        self.next = self.get_batch()
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def minimal_step(self):
        """The simplest loop a user writes, same model and arithmetic: tokens drawn on the device, no host data."""
        torch, a = self.torch, self.args
        x = torch.randint(a.vocab, (a.batch, a.ctx), device=self.dev)
        y = torch.randint(a.vocab, (a.batch, a.ctx), device=self.dev)
        with self.autocast():
            loss = self.fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def empty_cache(self):
        """Hand the allocator's cached blocks back (on CUDA), so that a waiting peer holds little beyond its weights
        and optimizer state while another process is timed."""
        if self.dev.type == "cuda":
            self.sync()
            self.torch.cuda.empty_cache()

    def timed(self, fn, steps: int) -> tuple[float, float, float]:
        """-> (ms a step, CPU ms a step of all threads, the last loss) over `steps` calls of fn."""
        self.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = fn()
        final = float(loss.item())
        self.sync()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        return dt / steps * 1e3, cpu / steps * 1e3, final

    def issue_times(self, steps: int = 5) -> tuple[float, float]:
        """-> (median ms the host takes to issue one step, median ms of that step synced), steps run one by one."""
        issue, whole = [], []
        for _ in range(steps):
            self.sync()
            t0 = time.perf_counter()
            self.step()
            t1 = time.perf_counter()
            self.sync()
            issue.append(t1 - t0)
            whole.append(time.perf_counter() - t0)
        return statistics.median(issue) * 1e3, statistics.median(whole) * 1e3

    def train(self, steps: int) -> float:
        """Time `steps` steps; print the train: and host: lines. -> tokens/s."""
        ms, cpu, final = self.timed(self.step, steps)
        print(f"train: {steps} steps after {self.args.warmup} warmup, loss {final:.4f}, {ms:.2f} ms/step, "
              f"{cpu:.2f} ms CPU time/step (all threads)")
        issue, synced = self.issue_times()
        print(f"host: {issue:.2f} ms to issue a step, {synced:.2f} ms a step synced one by one "
              f"({'bound by the host' if issue >= 0.9 * synced else 'the device sets the pace'})")
        sys.stdout.flush()
        return self.args.batch * self.args.ctx / ms * 1e3

    def check_minimal(self, rounds: int, steps: int, tolerance: float) -> bool:
        """Alternate `rounds` rounds of the peer's loop and the minimal loop; print both and the check."""
        for _ in range(3):  # the minimal loop's own first steps (its tensors come from another allocation pattern)
            self.minimal_step()
        peer, minimal = [], []
        for _ in range(rounds):
            peer.append(self.timed(self.step, steps)[0])
            minimal.append(self.timed(self.minimal_step, steps)[0])
        p, m = statistics.median(peer), statistics.median(minimal)
        ok = p <= m * (1 + tolerance)
        print(f"minimal loop: {rounds} rounds of {steps} steps alternated, peer "
              f"{', '.join(f'{x:.2f}' for x in peer)} ms/step, minimal {', '.join(f'{x:.2f}' for x in minimal)}")
        print(f"minimal check: {'passed' if ok else 'FAILED'} (peer {p:.2f} ms/step, minimal loop {m:.2f}, "
              f"peer/minimal {p / m:.3f}, tolerance {tolerance:g})")
        sys.stdout.flush()
        return ok


def serve(peer: Peer, tolerance: float) -> None:
    """Answer `train N` and `check R N` lines from stdin, each followed by `done`, until its end."""
    peer.empty_cache()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "train" and len(words) == 2:
            for _ in range(3):
                peer.step()
            peer.train(int(words[1]))
        elif words[0] == "check" and len(words) == 3:
            peer.check_minimal(int(words[1]), int(words[2]), tolerance)
        else:
            print(f"serve: unknown command {line.strip()!r} (train N, check R N)")
        peer.empty_cache()
        print("done", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        # fp32 means fp32 (no TF32) unless the peer is nanoGPT's, which turns TF32 on
        torch.backends.cuda.matmul.allow_tf32 = args.nanogpt
        torch.backends.cudnn.allow_tf32 = args.nanogpt
        dev_name = torch.cuda.get_device_name(torch.device("cuda"))
    else:
        import platform

        dev_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    torch.set_float32_matmul_precision("high" if args.nanogpt and args.device == "cuda" else "highest")
    torch.manual_seed(args.seed)
    peer = Peer(torch, args)

    how = ""
    if args.nanogpt:
        how = f" ({'torch.compile' if peer.compiled else 'eager, no torch.compile'}, bf16 autocast, fused AdamW)"
    print(f"device: torch {torch.__version__} {args.device}: {dev_name}{how}")
    a = args
    moe = f" E={a.experts} K={a.experts_used}" if a.arch == "llama" and a.experts else ""
    print(f"model: {a.arch} V={a.vocab} T={a.ctx} C={a.embd} F={a.ffn} H={a.heads}{moe} L={a.layers} B={a.batch}, "
          f"attention {a.attention}, {peer.n_params:,} parameters")
    sys.stdout.flush()
    for _ in range(args.warmup):
        peer.step()
    peer.sync()
    if args.serve:
        serve(peer, args.tolerance)
        return 0
    tps = peer.train(args.steps)
    if args.check_minimal:
        peer.check_minimal(args.check_minimal, args.steps, args.tolerance)
    if args.gemm > 0:
        gf, err = gemm_gflops(torch, args.gemm, args.device, peer.sync)
        lib = "cuBLAS" if args.device == "cuda" else "CPU BLAS"
        print(f"gemm {args.gemm}^2 fp32: torch matmul ({lib}) {gf:.1f} GFLOP/s, max rel err {err:.2e}")
    if args.profile > 0:
        profile_kernels(torch, peer.step, peer.sync, args.profile)
    print(f"tokens/s={tps:.1f}")
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

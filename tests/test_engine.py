"""The GPT-2 Engine beyond the contract every engine keeps (tests/test_engine_contract.py): biases off, clipping,
the GPU launch rows and the split products against the float64 reference, head dim 16, input errors; and the
device choice."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from clgpt.device.opencl import get_device, list_devices
from clgpt.errors import ClgptError
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref
from clgpt.models.gpt2 import GPT2Engine as Engine

from enginecheck import assert_two_runs_match_reference, batch, max_rel, noisy_params

ROOT = Path(__file__).resolve().parent.parent
# the noise on the parameters the GPT-2 checks were set with (the norms' weights and biases matter)
NOISE = 0.1


def tiny_cfg(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=23, n_ctx=5, n_embd=8, n_head=2, n_layer=2, n_ff=12, tied=tied)


def test_bias_off_trains_like_the_reference_without_biases():
    """model.bias false: the engine follows the float64 reference model whose biases are zero and not trained
    (nanoGPT's bias=False): the same losses, the pre-clip norm over the other gradients only, and the biases
    exactly zero after 10 AdamW steps with weight decay."""
    cfg = ModelConfig(vocab_size=29, n_ctx=8, n_embd=16, n_head=2, n_layer=2, n_ff=24, bias=False)
    p = init_params(cfg, 1)
    eng = Engine(cfg, p, batch_size=4, seq_len=8, knobs=Knobs())
    biases = {k: np.zeros(v.shape) for k, v in p.items() if k.endswith(".bias")}
    ref_w = {k: v.astype(np.float64) for k, v in p.items() if k not in biases}
    state: dict = {}
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0)
    for it in range(10):
        tokens, targets, mask = batch(cfg, 4, 8, seed=it)
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        norm = eng.step(**hp)
        loss_ref, cache = ref.gpt_forward({**ref_w, **biases}, cfg, tokens, targets, mask)
        grads = {k: v for k, v in ref.gpt_backward(cache).items() if k not in biases}
        ref_w, norm_ref = ref.adamw_step(ref_w, grads, state, **hp)
        assert abs(loss - loss_ref) < 1e-4 * abs(loss_ref), f"step {it}: loss {loss} vs reference {loss_ref}"
        assert abs(norm - norm_ref) < 1e-3 * norm_ref, f"step {it}: norm {norm} vs reference {norm_ref}"
    got = eng.get_params()
    assert all(not got[k].any() for k in biases), "a bias moved off zero"
    worst, where = max_rel({k: got[k] for k in ref_w}, ref_w)
    assert worst < 1e-3, f"params after 10 steps: max relative diff {worst:.3e} in {where}"


def test_clipping_scales_the_update():
    cfg = tiny_cfg(True)
    p = noisy_params(cfg, std=NOISE)
    tokens, targets, mask = batch(cfg, 2, 5)
    eng = Engine(cfg, p, batch_size=2, seq_len=5, knobs=Knobs())
    eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    g = eng.get_grads()
    norm = eng.step(lr=1e-2, clip=1e-3)
    want_norm = ref.grad_norm(g)
    assert abs(norm - want_norm) < 1e-5 * want_norm
    clipped = eng.get_grads()
    worst, where = max_rel(clipped, {k: v * (1e-3 / want_norm) for k, v in g.items()})
    assert worst < 1e-5, f"clipped grads: {worst:.3e} in {where}"
    state = {}
    want_p, _ = ref.adamw_step(p, g, state, lr=1e-2, clip=1e-3)
    worst, where = max_rel(eng.get_params(), want_p)
    assert worst < 1e-5, f"params after clipped step: {worst:.3e} in {where}"


@pytest.mark.parametrize("launch,C", [("nvidia", 16), ("gpu", 16), ("gpu", 128)])
def test_gpu_launch_path_vs_reference_and_determinism(launch, C):
    """The GPU launch row (split-K, batched attention, one work-group per row, two-stage column sums; C = 128:
    LayerNorm as 32 work-items a row) on this device: grads against the float64 reference, two runs
    bit-identical."""
    cfg = ModelConfig(vocab_size=37, n_ctx=80, n_embd=C, n_head=2, n_layer=1, n_ff=32)
    p = noisy_params(cfg, seed=3, std=NOISE)
    tokens, targets, mask = batch(cfg, 4, 80, seed=5)
    want_loss, cache = ref.gpt_forward(p, cfg, tokens, targets, mask)
    want_g = ref.gpt_backward(cache)
    runs = []
    for _ in range(2):
        eng = Engine(cfg, p, batch_size=4, seq_len=80, knobs=Knobs(launch=launch))
        eng.ops.facts.attn_gemm = True  # T = 80 is below the table's shortest sequence for batched attention
        eng.ops.launch["colsum_min_parts"] = 2  # 320 rows: two-stage column sums all the same
        assert eng.ops.rows and eng.ops.preset and ("layernorm_forward_rows" in eng.ops.k) == (C % 128 == 0)
        eng.ops.launch["ln_parts"] = 16  # 320 rows: 5 rows a row-slot
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    assert_two_runs_match_reference(runs, want_loss, want_g)


@pytest.mark.parametrize("M,N,K,ta,accum,kmax", [(37, 40, 300, 0, 0, 128), (37, 40, 300, 1, 1, 128),
                                                 (50, 33, 500, 0, 1, 64), (19, 64, 200, 0, 0, 64)])
def test_matmul_split_along_k_is_one_chain(M, N, K, ta, accum, kmax):
    """The CPU row's products with K above rb_kmax run as several launches, each going on with the raw sums of
    the one before (INIT): bit for bit what one launch gives, and the float64 product within fp32 rounding."""
    import pyopencl as cl

    cfg = ModelConfig(vocab_size=64, n_ctx=8, n_embd=16, n_ff=32, n_head=2, n_layer=1)
    ops = Engine(cfg, init_params(cfg, 0), 1, 8, knobs=Knobs(launch="cpu")).ops
    rng = np.random.default_rng(M + K)
    A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    B, C0 = rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
    mf, out = cl.mem_flags, []
    for km in (0, kmax):
        ops.launch["rb_kmax"] = km
        ops.rb_plans.clear()
        bufs = [cl.Buffer(ops.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=x) for x in (A, B, C0)]
        ops.matmul(M, N, K, *bufs, ta=ta, accum=accum, alpha=0.37)
        C = np.empty((M, N), np.float32)
        cl.enqueue_copy(ops.queue, C, bufs[2], is_blocking=True)
        out.append(C)
    assert -(-K // kmax) > 1 and isinstance(ops.rb_plans[next(iter(ops.rb_plans))][3], tuple), "not split"
    assert np.array_equal(out[0], out[1])
    want = 0.37 * ((A.T if ta else A).astype(np.float64) @ B) + (C0 if accum else 0.0)
    assert np.abs(out[1] - want).max() < 1e-4 * np.abs(want).max()


def test_engine_lm_head_split_along_k_same_grads():
    """A vocabulary above rb_kmax: the LM head's dx product (K = V) splits; the loss and every gradient are the
    bits of the unsplit run."""
    cfg = ModelConfig(vocab_size=200, n_ctx=16, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    p = noisy_params(cfg, seed=4, std=NOISE)
    tokens, targets, mask = batch(cfg, 3, 16, seed=6)
    runs = []
    for km in (0, 64):
        eng = Engine(cfg, p, batch_size=3, seq_len=16, knobs=Knobs(launch="cpu"))
        eng.ops.launch["rb_kmax"] = km
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    assert any(isinstance(plan[3], tuple) for plan in eng.ops.rb_plans.values()), "no product was split"
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert np.array_equal(runs[0][1][k], runs[1][1][k]), f"{k} differs with the split products"

def test_engine_input_errors():
    cfg = tiny_cfg(True)
    eng = Engine(cfg, init_params(cfg, 0), batch_size=2, seq_len=5, knobs=Knobs())
    with pytest.raises(ClgptError, match="tokens shape"):
        eng.forward(np.zeros((3, 5), np.int32))
    with pytest.raises(ClgptError, match="token ids"):
        eng.forward(np.full((1, 2), 23, np.int32))
    with pytest.raises(ClgptError, match="backward"):
        Engine(cfg, init_params(cfg, 0), batch_size=2, seq_len=5, knobs=Knobs()).backward()
    with pytest.raises(ClgptError, match="missing"):
        eng.set_params({})


def test_get_device_spec():
    name = get_device().name
    index = next(idx for idx, _, _, chosen, _ in list_devices() if chosen)
    assert get_device(index).name == name and get_device(name[:5].lower()).name == get_device(name[:5]).name
    with pytest.raises(ClgptError, match="no-such-device-xyz") as e:
        get_device("no-such-device-xyz")
    assert name in str(e.value)  # lists the available devices
    with pytest.raises(ClgptError, match="9:9"):
        get_device("9:9")
    devs = list_devices()
    assert sum(chosen for _, _, _, chosen, _ in devs) == 1 and all(idx.count(":") == 1 for idx, *_ in devs)


def test_get_device_env(monkeypatch):
    index = next(idx for idx, _, _, chosen, _ in list_devices() if chosen)
    monkeypatch.setenv("PYOPENCL_CTX", index)
    assert get_device() is get_device(index)
    monkeypatch.setenv("PYOPENCL_CTX", "7:3")
    with pytest.raises(ClgptError, match="7:3"):
        get_device()


class FakeDevice:
    """A stand-in for cl.Device with what the device choice reads."""

    def __init__(self, ptr, kind="CPU", platform="Portable Computing Language", version="OpenCL 3.0 PoCL 3.0",
                 name=None):
        import pyopencl as cl

        self.int_ptr, self.type = ptr, getattr(cl.device_type, kind)
        self.name = name or f"cpu {ptr}"
        self.platform = type("P", (), {"name": platform, "version": version})()


def _fake_devices(monkeypatch, fakes, broken):
    from clgpt.device import opencl as D

    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    monkeypatch.setattr(D, "_all_devices", lambda: [(f"{i}:0", d) for i, d in enumerate(fakes)])
    monkeypatch.setattr(D, "_probe", lambda d: "a test kernel failed (INVALID_KERNEL_NAME)" if d.int_ptr in broken
                        else "")
    return D


def test_auto_choice_skips_a_cpu_device_that_cannot_run_our_kernels(monkeypatch):
    """PyPI's PoCL builds a one-line kernel on CPUs its LLVM does not know, then fails on ours: the automatic
    choice and the ranks' matching_devices take the next CPU device that runs the probe kernel, and with none
    say what to install, in one line; an explicit choice of a broken device stops with one line too."""
    fakes = [FakeDevice(1), FakeDevice(2)]
    D = _fake_devices(monkeypatch, fakes, broken={1})
    assert D._pick(None) is fakes[1] and D.matching_devices(None) == [fakes[1]]
    with pytest.raises(ClgptError, match=r"^OpenCL device '0:0', 'cpu 1' .*cannot run clgpt's kernels.*"
                                         r"INVALID_KERNEL_NAME.*clgpt devices") as e:
        D._pick("0:0")
    assert "\n" not in str(e.value)
    D = _fake_devices(monkeypatch, fakes, broken={1, 2})
    with pytest.raises(ClgptError, match="no OpenCL device here can run.*cpu 1.*pip install") as e:
        D._pick(None)
    assert "\n" not in str(e.value)


def test_auto_choice_prefers_pocl_then_other_cpu_runtimes_and_never_a_simulator(monkeypatch):
    """Oclgrind lists itself as a GPU; it is skipped unless named. On CPUs, a working PoCL comes before Intel's
    runtime whatever the platform order; the ranks on a CPU all get the one device."""
    sim = FakeDevice(1, kind="ALL", platform="Oclgrind", version="OpenCL 1.2 (Oclgrind 21.10)",
                     name="Oclgrind Simulator")
    intel = FakeDevice(2, platform="Intel(R) OpenCL", version="OpenCL 3.1 LINUX", name="AMD EPYC")
    pocl = FakeDevice(3, name="pthread-AMD EPYC")
    D = _fake_devices(monkeypatch, [sim, intel, pocl], broken=set())
    assert D._pick(None) is pocl and D.matching_devices(None) == [pocl]
    assert D._pick("Intel") is intel and D._pick("oclgrind") is sim and D._pick("0:0") is sim
    assert D.matching_devices("EPYC") == [intel, pocl]  # a name part: every real device that holds it
    D = _fake_devices(monkeypatch, [sim, intel, pocl], broken={3})
    assert D._pick(None) is intel
    listing = {idx: note for idx, _, _, _, note in D.list_devices()}
    assert "simulator" in listing["0:0"] and listing["1:0"] == "" and "cannot run" in listing["2:0"]


@pytest.mark.parametrize("slow, words", [
    (dict(kind="ALL", platform="Oclgrind", version="OpenCL 1.2 (Oclgrind 21.10)", name="Oclgrind Simulator"),
     "is Oclgrind, a simulator"),
    (dict(kind="CPU", platform="rusticl", version="OpenCL 3.0", name="llvmpipe (LLVM 15.0.6, 256 bits)"),
     "is Mesa's llvmpipe, a software rasteriser"),
], ids=["oclgrind", "llvmpipe"])
def test_a_slow_device_runs_only_when_named_and_after_a_warning(monkeypatch, capsys, slow, words):
    """A simulator or a software rasteriser is never the automatic choice (llvmpipe lists itself as a GPU); named
    by index or name it runs, after one line that says how slow it is (once per process)."""
    dev, pocl = FakeDevice(1, **slow), FakeDevice(2, name="pthread-AMD EPYC")
    D = _fake_devices(monkeypatch, [dev, pocl], broken=set())
    monkeypatch.setattr(D, "_warned", set())
    assert D._pick(None) is pocl and capsys.readouterr().err == ""
    assert D._pick("0:0") is dev
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: OpenCL device '0:0' {words}") and "slower" in err[0], err
    assert D._pick("0:0") is dev and capsys.readouterr().err == ""  # said once
    assert "used only when named" in {idx: note for idx, _, _, _, note in D.list_devices()}["0:0"]
    if "llvmpipe" in dev.name:  # still one of the implementations the kernel tests run on, under its platform's name
        assert D.cpu_implementations() == {"pocl": "1:0", "rusticl": "0:0"}


def test_config_comment_gives_a_device_example_that_keeps_its_meaning():
    """An index ("0:0") names another device once another OpenCL package is installed (the test extra's
    Oclgrind lists first): the example in config.yaml's comment is a name."""
    comment = [line for line in (ROOT / "config.yaml").read_text().splitlines() if line.startswith("#")][:6]
    examples = [e for line in comment if "e.g." in line for e in re.findall(r'"([^"]*)"', line.split("e.g.")[1])]
    assert examples and not any(re.fullmatch(r"\d+(:\d+)?", e) for e in examples), comment


def test_probe_runs_a_real_kernel_on_the_chosen_device():
    """The probe builds kernels/adamw.cl, creates its work-group kernel and checks the sum it computes."""
    from clgpt.device import opencl as D

    dev = get_device().device
    D._probe_cache.pop(dev.int_ptr, None)
    assert D._probe(dev) == ""


def test_engine_head_dim_16_vs_reference():
    """Heads of 16 (D % 16 == 0): on CPUs the register-blocked attention products of kernels/attention.cl run;
    loss and grads against the float64 reference, and bit-identical repeats."""
    cfg = ModelConfig(vocab_size=23, n_ctx=13, n_embd=32, n_head=2, n_layer=2, n_ff=40, tied=False)
    p = noisy_params(cfg, std=NOISE)
    eng = Engine(cfg, p, batch_size=2, seq_len=13, knobs=Knobs())
    tokens, targets, mask = batch(cfg, 2, 13)
    grads = []
    for _ in range(2):
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        grads.append(eng.get_grads())
    loss_ref, cache = ref.gpt_forward(p, cfg, tokens, targets, mask)
    assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref), f"loss {loss} vs reference {loss_ref}"
    worst, where = max_rel(grads[1], ref.gpt_backward(cache))
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"
    assert all(np.array_equal(grads[0][k], grads[1][k]) for k in grads[0]), "repeat differs"


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
def test_next_logits_are_the_forward_logits_at_those_positions(arch):
    """Engine.next_logits (greedy decoding's step: the output projection at one position a row) gives exactly
    forward's logits there, bit for bit, for rows of different lengths; a position outside a row is an error."""
    from clgpt.models.factory import make_engine

    moe = dict(n_expert=4, n_expert_used=2) if arch == "moe" else {}
    cfg = ModelConfig(arch="gpt2" if arch == "gpt2" else "llama", vocab_size=61, n_ctx=16, n_embd=16, n_head=2,
                      n_layer=2, n_ff=40, **moe)
    eng = make_engine(cfg, init_params(cfg, 5), batch_size=4, seq_len=16, device=get_device(), knobs=Knobs())
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (3, 13), dtype=np.int32)
    last = np.array([12, 0, 6])
    full = eng.forward(tokens)
    assert np.array_equal(eng.next_logits(tokens, last), full[np.arange(3), last])
    with pytest.raises(ClgptError, match="one position in"):
        eng.next_logits(tokens, [13, 0, 0])

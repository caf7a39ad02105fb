"""LoRA adapters (clgpt/models/lora.py): the adapters' gradients against finite differences of the float64 reference
model, only the adapters train (the optimizer holds nothing else), the tune stage with tune.lora, and llama.cpp
applying the exported adapter GGUF to the base GGUF (`--lora`) agreeing with clgpt on the merged weights."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from enginecheck import batch, noisy_params
from test_llama_gguf import DIALOGS, N_CTX, PRETRAIN, llama_logits, load, prompt_ids
from test_train import data, pretrained, settings  # noqa: F401  (fixtures)

from clgpt.errors import ClgptError
from clgpt.inference.generate import Generator
from clgpt.io.checkpoint import load_checkpoint
from clgpt.io.gguf import export_gguf
from clgpt.models import reference as ref_gpt2
from clgpt.models import reference_llama as ref_llama
from clgpt.models.factory import make_engine
from clgpt.text.chat import encode_dialog, encode_prompt
from clgpt.models.lora import (
    A_SUFFIX,
    B_SUFFIX,
    LoraSpec,
    adapter_shapes,
    checkpoint_lora,
    export_adapter,
    lora_spec,
    merge,
)
from clgpt.model import ModelConfig, init_params
from clgpt.models.lora_engine import LoraEngine
from clgpt.models.reference import fd_entries
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import pad_dialogs, run_stage, stage_settings
from clgpt.device.knobs import Knobs

CFGS = {
    "llama": ModelConfig(arch="llama", vocab_size=40, n_ctx=16, n_embd=16, n_head=2, n_layer=2, n_ff=24,
                         n_head_kv=1),
    "gpt2": ModelConfig(arch="gpt2", vocab_size=40, n_ctx=16, n_embd=16, n_head=2, n_layer=1, n_ff=32),
}


def random_adapters(cfg, spec, seed=0, std=0.3):
    """Adapters with B nonzero too (a fresh B is zero, which would leave dA zero and untested)."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, std, s).astype(np.float32) for n, s in adapter_shapes(cfg, spec).items()}


def objective(cfg):
    if cfg.arch == "llama":
        return ref_llama.llama_objective
    return lambda p, c, *a: ref_gpt2.gpt_forward(p, c, *a)[0]


@pytest.mark.parametrize("kind", list(CFGS))
def test_adapter_grads_match_finite_differences(kind):
    """dL/dA, dL/dB of the engine against central differences of the float64 reference loss of W0 + s*B@A."""
    cfg = CFGS[kind]
    spec = lora_spec({"rank": 3, "alpha": 6}, cfg)
    base = noisy_params(cfg)
    adapters = random_adapters(cfg, spec)
    eng = LoraEngine(make_engine(cfg, base, batch_size=2, seq_len=5, optimizer=False, knobs=Knobs()), spec, seed=0, adapters=adapters)
    tokens, targets, mask = batch(cfg, 2, 5, seed=4)
    eng.zero_grad()
    eng.forward(tokens, targets, mask)
    eng.backward()
    grads = eng.get_grads()
    assert set(grads) == set(adapter_shapes(cfg, spec))

    base64 = {k: v.astype(np.float64) for k, v in base.items()}
    loss_of = objective(cfg)

    def f(a):
        p = dict(base64)
        for name in {n[: -len(A_SUFFIX)] for n in a if n.endswith(A_SUFFIX)}:
            p[name] = base64[name] + spec.scale * (a[name + B_SUFFIX] @ a[name + A_SUFFIX])
        return loss_of(p, cfg, tokens, targets, mask)

    a64 = {k: v.astype(np.float64) for k, v in adapters.items()}
    rng = np.random.default_rng(1)
    for name in a64:
        idxs = rng.choice(a64[name].size, size=4, replace=False)
        fd = fd_entries(f, a64, name, idxs, 1e-6)
        diff = np.abs(grads[name].flat[idxs] - fd).max()
        assert diff < 1e-6 + 1e-3 * np.abs(fd).max(), f"{name}: engine {grads[name].flat[idxs]}, fd {fd}"


def test_only_the_adapters_train():
    cfg = CFGS["llama"]
    spec = lora_spec({"rank": 2, "alpha": 4, "targets": ["attn_q", "ffn_down"]}, cfg)
    base = noisy_params(cfg)
    eng = LoraEngine(make_engine(cfg, base, batch_size=2, seq_len=6, optimizer=False, knobs=Knobs()), spec, seed=3)
    assert eng.base.store.flat_m is None and eng.base.store.flat_v is None  # no moments for the base
    assert all(np.array_equal(w, base[k]) for k, w in eng.get_params().items()), "B = 0: starts as the base"
    tokens, targets, mask = batch(cfg, 2, 6, seed=2)
    losses = []
    for _ in range(8):
        eng.zero_grad()
        losses.append(eng.forward(tokens, targets, mask))
        eng.backward()
        eng.step(1e-2)
    assert losses[-1] < losses[0] - 0.1, losses
    state = eng.get_optimizer_state()
    assert set(state["m"]) == set(state["v"]) == set(adapter_shapes(cfg, spec)) and state["t"] == 8
    tuned, adapters = eng.get_params(), eng.get_adapters()
    for name, w in tuned.items():
        if not name.startswith("blk.") or name.split(".")[2] not in spec.targets:
            assert np.array_equal(w, base[name]), f"{name} is not a target but changed"
            continue
        delta = w.astype(np.float64) - base[name]
        assert np.linalg.matrix_rank(delta, tol=1e-5) <= spec.rank
        np.testing.assert_allclose(w, merge(base, adapters, spec)[name], rtol=0, atol=1e-6)
    with pytest.raises(ClgptError, match="frozen"):
        eng.base.step(1e-2)


def test_settings_errors():
    cfg = CFGS["gpt2"]
    with pytest.raises(ClgptError, match=r"tune.lora.targets: 'attn_q' is not a matrix of this gpt2"):
        lora_spec({"targets": ["attn_q"]}, cfg)
    with pytest.raises(ClgptError, match=r"tune.lora.rank: 17 must lie in 1..16"):
        lora_spec({"rank": 17}, cfg)
    with pytest.raises(ClgptError, match=r"tune.lora.alpha"):
        stage_settings("tune", {"lora": {"alpha": 0}})
    with pytest.raises(ClgptError, match=r"tune.lora.ranks|tune.lora trains on one rank"):
        stage_settings("tune", {"lora": {"rank": 4}, "ranks": 2, "batch_size": 4})
    assert "lora" not in stage_settings("tune", {"lora": None}), "null: full tuning, settings as before"
    spec = lora_spec({}, ModelConfig(arch="llama", vocab_size=40, n_embd=64, n_head=4, n_ff=0))
    assert (spec.rank, spec.alpha, spec.targets[0]) == (16, 32.0, "attn_q") and len(spec.targets) == 7


def test_tune_stage_with_lora(data, pretrained, tmp_path):  # noqa: F811
    lora = {"rank": 4, "alpha": 8, "targets": ["attn_qkv", "ffn_up"]}
    args = ("tune", data["dialog"], settings(steps=10, lora=lora), str(tmp_path / "model.ckpt"),
            str(tmp_path / "log.csv"))
    run_stage(*args, init_ckpt=pretrained)
    ck, base = load_checkpoint(str(tmp_path / "model.ckpt")), load_checkpoint(pretrained)
    spec, adapters = checkpoint_lora(ck)
    assert spec == LoraSpec(4, 8.0, ("attn_qkv", "ffn_up"))
    assert set(ck["opt_state"]["m"]) == set(adapters) == set(adapter_shapes(ck["cfg"], spec))
    merged = merge(base["params"], adapters, spec)
    for name, w in ck["params"].items():
        np.testing.assert_allclose(w, merged[name], rtol=0, atol=1e-6, err_msg=name)
    assert not np.array_equal(ck["params"]["blk.0.ffn_up.weight"], base["params"]["blk.0.ffn_up.weight"])
    assert np.array_equal(ck["params"]["blk.0.ffn_down.weight"], base["params"]["blk.0.ffn_down.weight"])
    # interrupted and resumed, it ends with the same adapters
    out2 = tmp_path / "again"
    out2.mkdir()
    args2 = (*args[:3], str(out2 / "model.ckpt"), str(out2 / "log.csv"))

    def stop(step, loss):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage(*args2, init_ckpt=pretrained, callback=stop)
    run_stage(*args2, init_ckpt=pretrained)
    _, again = checkpoint_lora(load_checkpoint(str(out2 / "model.ckpt")))
    assert all(np.array_equal(again[k], adapters[k]) for k in adapters)


# ---- llama.cpp: base + adapter against the merged weights ----


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """A tiny llama pretrained on the lines, then LoRA-tuned (attention and ffn, rank 4) on the dialogs."""
    tok = Tokenizer.train(PRETRAIN + [f"{u} {a}" for u, a in DIALOGS], 320)
    cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, n_ctx=N_CTX, n_embd=32, n_layer=2, n_ff=64, n_head=4,
                      n_head_kv=2)
    rows = [([tok.bos_id, *tok.encode(s), tok.eos_id], 0) for s in PRETRAIN]
    tokens, targets, mask, _ = pad_dialogs(rows, N_CTX)
    eng = make_engine(cfg, init_params(cfg, 0), batch_size=tokens.shape[0], seq_len=tokens.shape[1], knobs=Knobs())
    for _ in range(40):
        eng.zero_grad()
        eng.forward(tokens, targets, mask)
        eng.backward()
        eng.step(1e-2, weight_decay=0.0)
    base = eng.get_params()
    spec = lora_spec({"rank": 4, "alpha": 8}, cfg)
    tokens, targets, mask, _ = pad_dialogs([encode_dialog(tok, u, a) for u, a in DIALOGS], N_CTX)
    lora = LoraEngine(make_engine(cfg, base, batch_size=tokens.shape[0], seq_len=tokens.shape[1], optimizer=False, knobs=Knobs()),
                      spec, seed=0)
    for _ in range(60):
        lora.zero_grad()
        loss = lora.forward(tokens, targets, mask)
        lora.backward()
        lora.step(1e-2)
    assert loss < 1.0, f"the adapters did not learn the dialogs (loss {loss:.3f})"  # 0.731 on PoCL
    d = tmp_path_factory.mktemp("lora")
    paths = {k: str(d / f"{k}.gguf") for k in ("base", "adapter", "merged")}
    merged = lora.get_params()
    export_gguf(paths["base"], cfg, base, tok, name="base")
    export_gguf(paths["merged"], cfg, merged, tok, name="merged")
    export_adapter(paths["adapter"], cfg, spec, lora.get_adapters(), name="adapter")
    return tok, cfg, merged, paths


def test_adapter_gguf_keys(lora_models):
    from gguf import GGUFReader

    tok, cfg, _, paths = lora_models
    r = GGUFReader(paths["adapter"])
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    assert kv["general.type"] == "adapter" and kv["adapter.type"] == "lora"
    assert kv["general.architecture"] == "llama" and kv["adapter.lora.alpha"] == 8.0
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}  # ggml ne: numpy shape reversed
    assert shapes["blk.1.attn_k.weight.lora_a"] == (32, 4) and shapes["blk.1.attn_k.weight.lora_b"] == (4, 16)
    assert len(shapes) == 2 * 7 * cfg.n_layer


def test_llama_cpp_with_adapter_equals_merged(lora_models):
    """Greedy output of llama.cpp's base + --lora equals clgpt's on the merged weights, token for token; the
    logits agree with the merged GGUF's in llama.cpp, and differ from the base's (the adapter is applied)."""
    tok, cfg, merged, paths = lora_models
    with_lora = llama_cpp.Llama(model_path=paths["base"], lora_path=paths["adapter"], n_ctx=N_CTX, logits_all=True,
                                verbose=False, seed=0)
    plain_merged, plain_base = load(paths["merged"]), load(paths["base"])
    gen = Generator(cfg, merged, knobs=Knobs())
    prompts = prompt_ids(tok)
    for ids in prompts:
        want = llama_logits(plain_merged, ids)
        got = llama_logits(with_lora, ids)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 2e-3 * scale, f"{ids}: {np.abs(got - want).max():.3g} of {scale:.3g}"
        ours = [t for t, _ in gen.generate(ids, max_tokens=20, greedy=True)]
        theirs = []
        for t in with_lora.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(int(t))
            if len(theirs) == len(ours):
                break
        assert ours == theirs, f"{tok.decode(ids)!r}: clgpt {tok.decode(ours)!r}, llama.cpp --lora {tok.decode(theirs)!r}"
    assert any(np.abs(llama_logits(plain_base, ids) - llama_logits(with_lora, ids)).max() > 0.1 for ids in prompts)
    for u, _ in DIALOGS:  # the chat answers, through the GGUF's template in llama.cpp with the adapter
        r = with_lora.create_chat_completion(messages=[{"role": "user", "content": u}], temperature=0.0,
                                             repeat_penalty=1.0, max_tokens=40, seed=0)
        ours = gen.generate(encode_prompt(tok, u), max_tokens=40, greedy=True, stop_ids=[tok.im_end_id])
        assert r["choices"][0]["message"]["content"] == tok.decode([t for t, _ in ours])

"""config.yaml validation: defaults, misspelt keys, out-of-range values, shapes that cannot work."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from clgpt.config import load_config, load_workflow_config, validate_config
from clgpt.errors import ClgptError

ROOT = Path(__file__).resolve().parent.parent


def test_default_config_validates_and_fills_defaults():
    cfg = load_config("config.yaml")
    assert set(cfg) >= {"device", "corpus", "tokenizer", "model", "pretrain", "tune", "evaluate", "export"}
    assert cfg["pretrain"]["grad_clip"] == 1.0  # not in config.yaml: filled from the schema
    assert cfg["tune"]["accum_steps"] == 1


def test_empty_config_is_all_defaults():
    cfg = validate_config({})
    assert cfg["model"]["n_ctx"] == 256 and cfg["export"]["type"] == "f32"


def test_label_smoothing_is_a_setting_of_both_training_stages():
    cfg = validate_config({"tune": {"label_smoothing": 0.1}})
    assert cfg["pretrain"]["label_smoothing"] == 0.0 and cfg["tune"]["label_smoothing"] == 0.1


@pytest.mark.parametrize("arch,n_embd,want", [("llama", 128, 352), ("llama", 384, 1024), ("llama", 256, 704),
                                              ("llama", 64, 192), ("gpt2", 128, 512), ("gpt2", 384, 1536)])
def test_n_ff_zero_is_the_architectures_usual_width(arch, n_embd, want):
    """model.n_ff 0 (the schema's default): gpt2 4 n_embd; llama 2/3 of that up to a multiple of 32, so its three
    SwiGLU matrices hold what gpt2's two do; an explicit n_ff stays; llama is the default architecture."""
    from clgpt.model import ModelConfig, param_shapes

    m = validate_config({"model": {"arch": arch, "n_embd": n_embd, "n_head": 4}})["model"]
    assert m["n_ff"] == 0
    cfg = ModelConfig.from_dict(m)
    assert cfg.n_ff == want
    assert ModelConfig.from_dict({**m, "n_ff": 100}).n_ff == 100
    if arch == "llama":
        ffn = lambda c: sum(int(np.prod(s)) for k, s in param_shapes(c).items() if "ffn" in k and len(s) == 2)
        ratio = ffn(cfg) / ffn(ModelConfig.from_dict({**m, "arch": "gpt2"}))
        assert 1 <= ratio < 1 + 3 * 32 / (8 * n_embd)  # rounding up to 32 columns adds less than 32
    assert validate_config({})["model"]["arch"] == "llama"
    assert ModelConfig.from_dict(load_config("config.yaml")["model"]).n_ff == 352


@pytest.mark.parametrize(
    "override, message",
    [
        ({"tune": {"lr_rate": 0.1}}, "unknown key 'tune.lr_rate'"),
        ({"modle": {}}, "unknown key 'modle'"),
        ({"tune": {"lr": -1.0}}, "tune.lr"),
        ({"pretrain": {"steps": 0}}, "pretrain.steps"),
        ({"tune": {"label_smoothing": 1.0}}, "tune.label_smoothing: 1.0 is greater than or equal to the maximum of 1"),
        ({"pretrain": {"label_smoothing": -0.1}}, "pretrain.label_smoothing: -0.1 is less than the minimum of 0"),
        ({"export": {"type": "q5_k"}}, "export.type"),
        ({"model": {"n_embd": 66, "n_head": 4}}, "model.n_embd=66 is not divisible by model.n_head=4"),
        ({"model": {"arch": "gpt2", "n_ctx": 300}}, "model.n_ctx=300 is not a multiple of 256"),
        ({"tokenizer": {"vocab_size": 100}}, "tokenizer.vocab_size"),
        ({"pretrain": {"seq_len": 512}}, "pretrain.seq_len=512 is longer than model.n_ctx=256"),
        ({"corpus": {"tune": "data/tune"}, "tune": {"seq_len": 512}}, "tune.seq_len=512 is longer than model.n_ctx=256"),
        ({"corpus": {"tune": "data/tune"}, "tune": {"ranks": 3, "batch_size": 2}},
         "tune.ranks=3 is more than tune.batch_size=2"),
        ({"model": {"n_embd": 48, "n_head": 4}, "export": {"type": "q8_0"}}, "model.n_embd=48 is not a multiple of 32"),
        ({"model": {"n_ff": 100}, "export": {"type": "q4_0"}}, "model.n_ff=100 is not a multiple of 32"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ClgptError) as e:
        validate_config(override)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_stage_that_does_not_run_is_not_checked():
    """Without dialogs there is no tune stage, so its settings (the defaults' included) may not fit the model."""
    config = validate_config({"corpus": {"tune": None}, "tune": {"seq_len": 512, "ranks": 3, "batch_size": 2}})
    assert config["tune"]["seq_len"] == 512


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_recipe_configs_validate_beside_the_default_config(recipe):
    """`snakemake --configfile configs/X.yaml` merges the recipe over config.yaml: every shipped recipe must pass."""
    config = load_workflow_config(str(ROOT / "config.yaml"), [str(ROOT / "configs" / recipe)])
    assert config["model"]["n_ctx"] >= config["pretrain"]["seq_len"]


def test_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("model:\n  n_embd: [1,\n")
    with pytest.raises(ClgptError, match=r"config.yaml:3:1: not valid YAML"):
        load_config(str(p))


def test_quantized_export_accepts_multiples_of_32():
    cfg = validate_config({"model": {"n_embd": 64, "n_head": 2, "n_ff": 128}, "export": {"type": "q4_0"}})
    assert cfg["export"]["type"] == "q4_0"


def test_schema_defaults_match_config_yaml_keys():
    """Every key in config.yaml is one the schema knows (no silent typos in the shipped file)."""
    with open("config.yaml") as f:
        raw = yaml.safe_load(f)
    validate_config(raw)

"""Every mistake a user makes gets clgpt's own one-line answer naming the file, line or key, before any
work runs; no input in these tests gets a Python traceback, from the workflow or from the CLI."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clgpt.config import defaults, load_schema, load_workflow_config, plain_scalar, read_yaml, validate_config
from clgpt.data import read_dialogs, read_text
from clgpt.data.preflight import check_corpus
from clgpt.errors import ClgptError
from clgpt.stage import code_inputs, run_script, running_stages, stale_lock
from test_pipeline import (TINY, assert_one_line, default_signals, make_workdir, one_line_error, planned_rules,
                           snakemake, write_config)

ROOT = Path(__file__).resolve().parent.parent


def config_error(tmp_path: Path, text, *extra_files, overrides=None) -> str:
    p = tmp_path / "config.yaml"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    with pytest.raises(ClgptError) as e:
        load_workflow_config(str(p), extra_files, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- reading config.yaml --------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("1e-3", 0.001), ("3.0e-4", 3e-4), ("2E-3", 0.002), (".5", 0.5),
                                         ("1:0", "1:0"), ("yes", "yes"), ("010", 10), ("0x10", 16), ("true", True)])
def test_yaml_12_plain_scalars(text, value):
    assert plain_scalar(text) == value and type(plain_scalar(text)) is type(value)


def test_lr_1e_3_is_a_float_and_device_1_0_is_text(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text('device: 1:0\ntune:\n  lr: 1e-3\n  min_lr: 1e-4\npretrain:\n  steps: 3.0\n')
    cfg = load_workflow_config(str(p))
    assert cfg["tune"]["lr"] == 0.001 and cfg["tune"]["min_lr"] == 1e-4
    assert cfg["device"] == "1:0"
    assert cfg["pretrain"]["steps"] == 3 and type(cfg["pretrain"]["steps"]) is int


def test_device_as_a_number_names_the_quoting_fix():
    with pytest.raises(ClgptError, match=r'device: the number 60 .*base-60 number 60\); quote it: device: "1:0"'):
        validate_config({"device": 60})


def test_error_names_file_line_and_key(tmp_path):
    msg = config_error(tmp_path, "model:\n  n_embd: 128\ntune:\n  epochs: 40\n  lr: -1\n")
    assert msg.startswith(f"{tmp_path / 'config.yaml'}:5: tune.lr:"), msg


def test_unknown_key_suggests_the_near_one(tmp_path):
    msg = config_error(tmp_path, "model:\n  n_embed: 64\n")
    assert msg.endswith("config.yaml:2: model.n_embed: unknown key 'model.n_embed'; did you mean 'n_embd'? "
                        "allowed here: " + ", ".join(sorted(load_schema()["properties"]["model"]["properties"]))), msg


@pytest.mark.parametrize(
    "text, expected",
    [
        (b"model:\n  n_embd: [1,\n", r":\d+:\d+: not valid YAML \(.*\); fix the syntax"),
        (b"model:\n\tn_embd: 64\n", r":2: indented with a tab; YAML indents with spaces only"),
        (b"export:\n  name: caf\xe9\n", r":2: byte 0xe9 \(offset 19\) is not UTF-8"),
        (b"tune:\n  lr: 0.1\n  lr: 0.2\n", r":3: key 'lr' is given twice \(first on line 2\)"),
        (b"- a\n- b\n", r":1: expected sections"),
        (b"tune:\n  lr:\n", r":2: tune.lr: empty; give a number, or remove the line to use the default \(0.002\)"),
        (b"model:\n  tied: yes\n", r":2: model.tied: 'yes' is not true or false"),
        (b"tune:\n  lr: .inf\n", r":2: tune.lr: inf is not a finite number"),
        (b"tune: 3\n", r":1: tune: expected a section"),
    ],
    ids=["invalid", "tab", "latin1", "duplicate", "list", "empty-value", "yes", "inf", "scalar-section"],
)
def test_bad_config_file_is_one_line(tmp_path, text, expected):
    import re

    msg = config_error(tmp_path, text)
    assert msg.startswith(str(tmp_path / "config.yaml")), msg
    assert re.search(expected, msg), msg


@pytest.mark.parametrize("text, where", [
    ('device: ""\ntune:\n  lr 1e-3\n  steps: 3\n', "config.yaml:3:3: not valid YAML"),  # a key without its ':'
    ('device: ""\ntune:\n  epochs: [1, 2\n  steps: 3\n', "config.yaml:3:11: not valid YAML"),  # a bracket left open
])
def test_yaml_syntax_error_names_the_line_of_the_mistake(tmp_path, text, where):
    """YAML finds these a line later; the line named is the one to fix."""
    msg = config_error(tmp_path, text)
    assert msg.startswith(str(tmp_path / where)) and "noticed on line 4" in msg, msg


def test_missing_config_file(tmp_path):
    with pytest.raises(ClgptError, match=r"nope.yaml: config file not found"):
        load_workflow_config(str(tmp_path / "config.yaml"), [str(tmp_path / "nope.yaml")])


def test_empty_config_warns_and_takes_the_defaults(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("# nothing set yet\n")
    said = []
    cfg = load_workflow_config(str(p), warn=said.append)
    assert cfg == validate_config({})
    assert len(said) == 1 and "has no settings" in said[0] and "\n" not in said[0]


def test_section_with_every_key_commented_out_is_its_defaults(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("evaluate:\n  # max_tokens: 48\n  # batch_size: 16\nexport:\n  type: f16\n")
    cfg = load_workflow_config(str(p))
    assert cfg["evaluate"] == defaults("evaluate") and cfg["export"]["type"] == "f16"


def test_configfiles_and_overrides_merge_in_order_and_name_their_file(tmp_path):
    (tmp_path / "config.yaml").write_text("tune:\n  lr: 0.002\n  epochs: 5\n")
    (tmp_path / "more.yaml").write_text("# more\ntune:\n  epochs: 7\nevaluate:\n")
    cfg = load_workflow_config(str(tmp_path / "config.yaml"), [str(tmp_path / "more.yaml")],
                               {"tune": {"lr": "1e-3"}})
    assert cfg["tune"]["epochs"] == 7 and cfg["tune"]["lr"] == 0.001
    (tmp_path / "more.yaml").write_text("# more\ntune:\n  epochs: -7\n")
    with pytest.raises(ClgptError, match=r"more.yaml:3: tune.epochs: -7 is less than the minimum of 0"):
        load_workflow_config(str(tmp_path / "config.yaml"), [str(tmp_path / "more.yaml")])
    with pytest.raises(ClgptError, match=r"^--config: export.type: 'q5' is not one of"):
        load_workflow_config(str(tmp_path / "config.yaml"), (), {"export": {"type": "q5"}})


def test_read_yaml_strips_a_bom_and_knows_lines(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xef\xbb\xbfmodel:\n  n_embd: 64\n")
    data, lines = read_yaml(p)
    assert data == {"model": {"n_embd": 64}} and lines[("model", "n_embd")] == 2


# ---- the property: any value either validates or is one line naming its key ---------------------

def _leaf_schemas():
    schema = load_schema()
    out = [(("device",), schema["properties"]["device"])]
    for section, sub in schema["properties"].items():
        for key, leaf in sub.get("properties", {}).items():
            out.append(((section, key), leaf))
    return out


LEAVES = _leaf_schemas()
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.integers(), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["1e-3", "1:0", "yes", "0:0", "q4_0", "llama", "", "data/none"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@example(changes=[], top={"tune": {"\n": 0}})  # a quoted key with a newline: the message stays one line
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(LEAVES), ANY_VALUE), max_size=4),
       st.dictionaries(st.sampled_from(["modle", "tune", "export", "x"]), ANY_VALUE, max_size=2))
def test_any_config_validates_or_names_a_key(changes, top):
    config = {k: v for k, v in top.items()}
    for (path, _), value in changes:
        if len(path) == 1:
            config[path[0]] = value
        else:
            section = config.get(path[0])
            if not isinstance(section, dict):
                section = config[path[0]] = {}
            section[path[1]] = value
    try:
        validate_config(config)
    except ClgptError as e:
        msg = str(e)
        assert "\n" not in msg
        named = {".".join(p) for (p, _), _ in changes} | set(map(str, top)) | {p[0] for (p, _), _ in changes}
        named |= {"model", "tokenizer", "pretrain", "tune", "export", "model.n_embd", "model.n_ff", "model.n_ctx"}
        assert any(key in msg for key in named), msg


@pytest.mark.parametrize(
    "config, expect",
    [
        ({**TINY, "pretrain": {**TINY["pretrain"], "lr": "1e-3"}}, None),  # written as text in YAML: `lr: '1e-3'`
        ({**TINY, "evaluate": None}, None),
        ({**TINY, "device": "9:9"}, "OpenCL device '9:9' not found"),
    ],
    ids=["lr-as-text", "null-section", "no-device"],
)
def test_dry_run_passes_or_gives_one_line(tmp_path, config, expect):
    path = make_workdir(tmp_path / "wf", TINY)
    text = yaml.safe_dump(config)
    (path / "config.yaml").write_text(text.replace("lr: '1e-3'", "lr: 1e-3"))
    r = snakemake(path, "-n", "model.gguf")
    out = r.stdout + r.stderr
    if expect is None:
        assert r.returncode == 0 and "Traceback" not in out, out
    else:
        assert r.returncode != 0 and expect in one_line_error(out)


# ---- the workflow stops at parse time with one line --------------------------------------------

def _cut(p: Path, text: bytes):
    p.write_bytes(text)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: (p / "config.yaml").write_bytes(b"model:\n\tn_embd: 64\n"), "config.yaml:2: indented with a tab"),
        (lambda p: (p / "config.yaml").write_bytes(b"export:\n  name: caf\xe9\n"), "config.yaml:2: byte 0xe9"),
        (lambda p: (p / "config.yaml").write_bytes(b"model: [1,\n"), "config.yaml:2:1: not valid YAML"),
        (lambda p: (p / "data/heldout/pretrain.txt").write_text(" \n\n"), "corpus.pretrain_heldout: data/heldout/pretrain.txt is empty"),
        (lambda p: (p / "data/heldout/tune.jsonl").unlink(), "corpus.tune_heldout: data/heldout/tune.jsonl does not exist"),
        (lambda p: write_config(p, {**TINY, "corpus": {**TINY["corpus"], "tune_accept": "data/heldout/accept.json"}}),
         "corpus.tune_accept: data/heldout/accept.json does not exist"),
        (lambda p: (p / "data/pretrain/empty.txt").write_text(""), "corpus.pretrain: data/pretrain/empty.txt is empty"),
        (lambda p: write_config(p, {**TINY, "corpus": {"pretrain": "data/pretrain/en.txt"}}),
         "corpus.pretrain: data/pretrain/en.txt is a file; set corpus.pretrain to the folder"),
    ],
    ids=["tab", "latin1", "invalid", "empty-heldout", "missing-heldout", "missing-accept", "empty-file", "file-not-folder"],
)
def test_workflow_stops_at_parse_time_with_one_line(tmp_path, breakage, message):
    path = make_workdir(tmp_path / "wf", TINY)
    breakage(path)
    r = snakemake(path, "-n", "model.gguf")
    assert r.returncode != 0
    assert message in one_line_error(r.stdout + r.stderr)


def test_configfile_is_read_by_clgpts_loader(tmp_path):
    """A --configfile is read again with YAML 1.2 numbers, and its mistakes name it and the line. (A
    --configfile that does not exist or is not YAML at all is read by Snakemake itself before the
    workflow runs: tests/test_user_mistakes.py::test_plain_snakemake_names_an_argument_it_refuses.)"""
    path = make_workdir(tmp_path / "wf", TINY)
    (path / "more.yaml").write_text("# overrides\ntune:\n  lr: 1e-3\n  warmup_steps: -1\n")
    r = snakemake(path, "-n", "model.gguf", "--configfile", "more.yaml")  # nargs="+": the target first
    assert r.returncode != 0
    assert "more.yaml:4: tune.warmup_steps: -1 is less than the minimum of 0" in one_line_error(r.stdout + r.stderr)


def test_configfile_and_config_reach_the_rules(tmp_path):
    path = make_workdir(tmp_path / "wf", TINY)
    (path / "fast.yaml").write_text("tune:\n  lr: 1e-3\n")
    r = snakemake(path, "-n", "model.gguf", "--configfile", "fast.yaml", "--config", "export={'type': 'f16'}")
    assert r.returncode == 0, r.stdout + r.stderr
    r = snakemake(path, "-n", "model.gguf", "--configfile", "fast.yaml", "--config", "export={'type': 'q5'}")
    assert r.returncode != 0
    assert one_line_error(r.stdout + r.stderr).startswith("error: --config: export.type: 'q5' is not one of")


# ---- the corpus ---------------------------------------------------------------------------------

def corpus(tmp_path: Path) -> dict:
    for sub in ("pretrain", "tune", "heldout"):
        (tmp_path / sub).mkdir(exist_ok=True)
    (tmp_path / "pretrain/en.txt").write_text("The cat sat.\n")
    (tmp_path / "tune/en.jsonl").write_text('{"user": "Hi", "assistant": "Hello!"}\n')
    (tmp_path / "heldout/pretrain.txt").write_text("A dog ran.\n")
    (tmp_path / "heldout/tune.jsonl").write_text('{"user": "Bye", "assistant": "Bye!"}\n')
    return {"pretrain": str(tmp_path / "pretrain"), "tune": str(tmp_path / "tune"),
            "pretrain_heldout": str(tmp_path / "heldout/pretrain.txt"),
            "tune_heldout": str(tmp_path / "heldout/tune.jsonl")}


def test_dot_files_are_skipped(tmp_path):
    c = corpus(tmp_path)
    (tmp_path / "pretrain/._en.txt").write_bytes(b"\x00\x05\x16\x07 mac resource fork")
    (tmp_path / "tune/.hidden.jsonl").write_text("not json\n")
    files = check_corpus(c)
    assert files == {"pretrain": [str(tmp_path / "pretrain/en.txt")], "tune": [str(tmp_path / "tune/en.jsonl")]}


@pytest.mark.parametrize("name", ["pretrain/en.txt", "tune/en.jsonl", "heldout/pretrain.txt", "heldout/tune.jsonl"])
@pytest.mark.parametrize("content", ["", "  \n\t\n\n"], ids=["empty", "whitespace"])
def test_empty_or_blank_corpus_file_is_refused(tmp_path, name, content):
    c = corpus(tmp_path)
    (tmp_path / name).write_text(content)
    with pytest.raises(ClgptError, match=rf"corpus\.\w+: {tmp_path / name} is empty"):
        check_corpus(c)


def test_heldout_folder_and_corpus_file_are_named(tmp_path):
    c = corpus(tmp_path)
    with pytest.raises(ClgptError, match=r"corpus.tune_heldout: .* is a folder; set corpus.tune_heldout to one file"):
        check_corpus({**c, "tune_heldout": str(tmp_path / "tune")})
    with pytest.raises(ClgptError, match=r"corpus.tune: .*en.jsonl is a file; set corpus.tune to the folder"):
        check_corpus({**c, "tune": str(tmp_path / "tune/en.jsonl")})
    with pytest.raises(ClgptError, match=r"corpus.pretrain_heldout: .*nope.txt does not exist"):
        check_corpus({**c, "pretrain_heldout": str(tmp_path / "nope.txt")})


def test_bom_is_stripped_in_text_and_dialogs(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfThe cat sat.\nA dog ran.\n")
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"user": "Hi", "assistant": "Hello!"}\n')
    assert list(read_text([str(tmp_path / "a.txt")])) == ["The cat sat.", "A dog ran."]
    assert read_dialogs([str(tmp_path / "a.jsonl")])[0]["messages"][0] == {"role": "user", "content": "Hi"}


# ---- the CLI -----------------------------------------------------------------------------------

def clgpt(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "clgpt", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from clgpt.io.gguf import export_gguf
    from clgpt.model import ModelConfig, init_params
    from clgpt.text.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("cli")
    tok = Tokenizer.train(["The cat sat on the mat.", "Water boils at one hundred degrees."], 280)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    export_gguf(str(d / "m.gguf"), cfg, init_params(cfg, seed=1), tok)
    return d / "m.gguf"


def test_generate_device_option_works(gguf):
    r = clgpt("generate", str(gguf), "--prompt", "The cat", "--greedy", "--max-tokens", "2", "--device", "0:0")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = clgpt("generate", str(gguf), "--prompt", "The cat", "--device", "7:7")
    assert r.returncode == 1 and "OpenCL device '7:7' not found" in one_line_error(r.stderr)


def test_generate_refuses_a_prompt_longer_than_the_context(gguf):
    r = clgpt("generate", str(gguf), "--prompt", "cat " * 300)
    assert r.returncode == 1 and "model's context is 256" in one_line_error(r.stderr) and r.stdout == ""


def test_tokenize_gguf_without_tokenizer(tmp_path):
    import gguf as gguf_lib

    p = tmp_path / "bare.gguf"
    w = gguf_lib.GGUFWriter(str(p), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = clgpt("tokenize", str(p), "hi")
    assert r.returncode == 1 and "carries no tokenizer" in one_line_error(r.stderr)


def test_generate_on_a_lora_adapter_names_the_model_to_run(tmp_path):
    """lora/adapter.gguf holds the adapter only: the fix is model.gguf, or llama.cpp's --lora, not a tokenizer."""
    import gguf as gguf_lib

    p = tmp_path / "adapter.gguf"
    w = gguf_lib.GGUFWriter(str(p), "llama")
    w.add_type("adapter")
    w.add_key_value("adapter.type", "lora", gguf_lib.GGUFValueType.STRING)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = clgpt("generate", str(p), "--prompt", "hi")
    line = one_line_error(r.stderr)
    assert r.returncode == 1 and "LoRA adapter, not a model" in line and "model.gguf" in line and "--lora" in line
    assert "tokenizer" not in line


@pytest.mark.parametrize("lora, words", [({"targets": []}, "tune.lora.targets is empty"),
                                         ({"rank": 4}, "tune.lora is set but there is no tune stage")])
def test_lora_settings_that_would_do_nothing_are_named(tmp_path, lora, words):
    corpus = {} if "targets" in lora else {"corpus": {"tune": ""}}
    text = yaml.safe_dump({**corpus, "tune": {"lora": lora}})
    assert words in config_error(tmp_path, text)


def test_a_full_tune_after_a_lora_one_removes_the_old_adapter(tmp_path):
    """lora/base.gguf and lora/adapter.gguf of an earlier LoRA tune would still run the old model in llama.cpp."""
    path = make_workdir(tmp_path / "wf")
    (path / "lora").mkdir()
    for name in ("base.gguf", "adapter.gguf"):
        (path / "lora" / name).write_bytes(b"old")
    r = snakemake(path, "model.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (path / "lora/base.gguf").exists() and not (path / "lora/adapter.gguf").exists()
    assert "removed lora/base.gguf and lora/adapter.gguf of the earlier LoRA tune" in r.stderr


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (lambda d: (d / "a.txt").write_text("some text\n"), ["a.txt", "--out", "nodir/t.json"], "folder nodir does not exist"),
        (lambda d: (d / "a.txt").write_text(" \n"), ["a.txt", "--out", "t.json"], "no text to train on"),
        (lambda d: (d / "a.txt").write_text("ab ab\n"), ["a.txt", "--out", "t.json"], "--vocab-size 300 cannot be reached"),
        (lambda d: None, ["missing.txt", "--out", "t.json"], "missing.txt: cannot read"),
        (lambda d: ((d / "a.txt").write_text("some text\n"), (d / "data").mkdir()), ["a.txt", "--out", "data"],
         "--out data: this is a folder; give the tokenizer file's name (e.g. --out data/tokenizer.json)"),
    ],
    ids=["missing-out-folder", "empty-file", "unreachable-vocab", "missing-input", "out-is-a-folder"],
)
def test_train_tokenizer_bad_input_is_one_line(tmp_path, setup, args, message):
    setup(tmp_path)
    r = subprocess.run([sys.executable, "-m", "clgpt", "train-tokenizer", *args, "--vocab-size", "300"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and message in one_line_error(r.stderr)
    assert not (tmp_path / "t.json").exists()


def test_devices_with_a_bad_pyopencl_ctx_says_so():
    r = clgpt("devices", env={"PYOPENCL_CTX": "9:9"})
    assert r.returncode == 1 and "PYOPENCL_CTX='9:9' matches none of them" in one_line_error(r.stderr)
    assert "0:0" in r.stdout


# ---- stage scripts: OSError, Ctrl-C, a lost parent ----------------------------------------------

def _run_script_in_child(body: str, log: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import time
        from clgpt.stage import run_script
        def main():
            {body}
        run_script(main, {str(log)!r})
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=default_signals)


def test_read_only_output_is_one_line(tmp_path):
    body = "raise PermissionError(13, 'Permission denied', 'results/tune/model.ckpt.partial')"
    proc = _run_script_in_child(body, tmp_path / "log")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "results/tune/model.ckpt.partial: Permission denied; make the folder writable" in one_line_error(err)


STOPS = [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGHUP, "stopped by SIGHUP")]


@pytest.mark.parametrize("sig, words", STOPS, ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_stop_signal_gives_one_line(tmp_path, sig, words):
    """Ctrl-C, `kill PID` and a closed terminal each end a stage with one line and 128 + the signal's number."""
    proc = _run_script_in_child("print('ready', flush=True); time.sleep(60)", tmp_path / "log")
    assert proc.stdout.readline() == "ready\n"  # in main(): run_script's handlers are in place
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert one_line_error(err) == f"error: {words}; run snakemake again to resume"


def test_a_bug_in_a_stage_is_one_line_and_its_traceback_goes_to_the_log(tmp_path):
    proc = _run_script_in_child("{}['missing']", tmp_path / "log")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    line = one_line_error(err)
    assert line.startswith("error: KeyError: 'missing'; this is a bug in clgpt") and str(tmp_path / "log") in line
    assert "Traceback" in (tmp_path / "log").read_text()


def test_sighup_ignored_by_nohup_stays_ignored(tmp_path):
    """`nohup snakemake ...` means: outlive the terminal. A stage started so keeps running on SIGHUP."""
    def nohup():
        default_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    code = textwrap.dedent("""
        import sys
        from clgpt.stage import run_script
        def main():
            print('ready', flush=True)
            sys.stdin.readline()
            print('still here', flush=True)
        run_script(main, None)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=nohup)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0 and out == "still here\n", err


def sigint_ignored() -> None:
    """preexec_fn of a run started as a script or a scheduler starts one in the background: SIGINT ignored."""
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkflowRun:
    """`python -m snakemake --cores 1 model.gguf` started in a workflow folder, its output (stdout and stderr)
    read as it comes by a thread, so a test waits for what the run prints (an event), never for a time."""

    def __init__(self, path: Path, proc: subprocess.Popen):
        self.path, self.proc = path, proc
        self._out, self._ended = b"", False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: os.read(self.proc.stdout.fileno(), 65536), b""):
            with self._changed:
                self._out += chunk
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Returns once the output shows `text`; fails when the run's output ends first or `timeout` passes."""
        with self._changed:
            self._changed.wait_for(lambda: text.encode() in self._out or self._ended, timeout)
            assert text.encode() in self._out, self._out.decode(errors="replace")

    def output(self, timeout: float = 60) -> str:
        """The whole output, once the run (and every process that shares its output) has ended."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "a process of the run still holds its output open"
        return self._out.decode(errors="replace")


@contextmanager
def start_workflow(tmp_path: Path, steps: int = 1_000_000, dispositions=default_signals):
    """A WorkflowRun of the tiny pipeline whose pretrain stage would run `steps` steps (far longer than a test:
    only a stop or a kill ends it), started with the signal dispositions `dispositions` sets (the stop signals'
    defaults); on leaving, whatever of it still runs is killed (its stages first: they outlive a killed
    Snakemake)."""
    config = json.loads(json.dumps(TINY))
    config["pretrain"].update(steps=steps, checkpoint_every=steps)
    path = make_workdir(tmp_path / "wf", config).resolve()
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "model.gguf"], cwd=path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=dispositions)
    run = WorkflowRun(path, proc)
    try:
        yield run
    finally:
        if proc.poll() is None:
            for pid in running_stages(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


def _stage_pid(cwd: Path, script: str) -> int:
    """The pid of the process running `scripts/SCRIPT` in the workflow folder `cwd`."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            if any(a.endswith(f"scripts/{script}".encode()) for a in argv[:3]) and \
                    Path(os.readlink(f"/proc/{entry}/cwd")) == cwd:
                return int(entry)
        except OSError:
            pass
    raise AssertionError(f"no process runs scripts/{script} in {cwd}")


def _ctrl_c_in_a_terminal(cmd: list[str], cwd: Path, when: bytes, timeout: float = 300,
                          stop=None) -> tuple[str, int]:
    """Run `cmd` on a pseudo-terminal and type Ctrl-C once its output shows `when`, as a user at a terminal
    does (the terminal sends SIGINT to every process of the run), or call `stop()` then; its output and exit
    status."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:
        default_signals()  # a terminal's defaults, also when the suite runs in the background
        os.chdir(cwd)
        os.execvp(cmd[0], cmd)
    out, typed, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the run ended and closed the terminal
                break
            if not chunk:
                break
            out += chunk
        if not typed and when in out:
            os.write(fd, b"\x03") if stop is None else stop()
            typed = True
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert typed, out.decode(errors="replace")
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("sig, words", STOPS, ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_in_the_pipeline_ends_with_clgpts_line(tmp_path, sig, words):
    """Ctrl-C during pretrain (SIGTERM, SIGHUP: sent to the stage, as `kill PID` or a cluster's time limit
    does): the stage's checkpoint line and its one `error:` line, and no failed-job block from Snakemake after
    them (it would print the whole shell line and a CalledProcessError); the next run plans pretrain again
    (to resume) instead of stopping on an incomplete file."""
    config = json.loads(json.dumps(TINY))
    config["pretrain"].update(steps=100000, checkpoint_every=100000)
    path = make_workdir(tmp_path / "wf", config).resolve()
    stop = None if sig == signal.SIGINT else (lambda: os.kill(_stage_pid(path, "pretrain.py"), sig))
    out, code = _ctrl_c_in_a_terminal([sys.executable, "-m", "snakemake", "--cores", "1", "model.gguf"], path,
                                      when=b"loss=", stop=stop)  # a step is done: training runs
    assert code != 0
    tail = out[out.index("saved step") - 200:] if "saved step" in out else out
    assert f"pretrain: {words}; saved step" in tail and "run again to resume" in tail, tail
    assert one_line_error(tail) == f"error: {words}; run snakemake again to resume"
    assert tail.rstrip().endswith(f"error: {words}; run snakemake again to resume"), tail
    assert_one_line(tail)
    assert (path / "results/staging/pretrain/model.ckpt.partial").exists()
    # "run snakemake again" works as said: no output is left that Snakemake marked incomplete
    assert not (path / "results/staging/pretrain/log.csv").exists()
    assert (path / "results/staging/pretrain/log.csv.partial").exists()
    assert "pretrain" in planned_rules(path)


@pytest.mark.parametrize("dispositions", [default_signals, sigint_ignored], ids=["terminal", "background"])
def test_a_stage_error_is_the_last_line(tmp_path, dispositions):
    """A bad line in a tune file: the stage's one line, and nothing of Snakemake's failed-job block after it,
    whether Snakemake started with SIGINT live (a terminal) or ignored (in the background: Snakemake's own
    Ctrl-C handler, which once alone quieted the block, is not set then)."""
    path = make_workdir(tmp_path / "wf")
    with open(path / "data/tune/en.jsonl", "a") as f:
        f.write('{"messages": [}\n')
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "model.gguf"], cwd=path,
                       capture_output=True, text=True, timeout=900, preexec_fn=dispositions)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert one_line_error(out).startswith("error: data/tune/en.jsonl:13: not valid JSON"), out
    assert out.rstrip().splitlines()[-1] == one_line_error(out), out
    assert_one_line(out)


def test_a_stage_killed_outright_gets_clgpts_line(tmp_path):
    """kill -9 (or the kernel's out-of-memory killer) leaves the stage no time to speak: clgpt's line says
    which stage ended and how, instead of Snakemake's block."""
    with start_workflow(tmp_path) as run:
        run.wait_for("loss=")  # a step is done: training runs
        os.kill(_stage_pid(run.path, "pretrain.py"), signal.SIGKILL)
        run.proc.wait(300)
    out = run.output()
    assert run.proc.returncode != 0
    assert out.rstrip().splitlines()[-1] == ("error: stage pretrain was killed by SIGKILL (out of memory, or `kill -9`); "
                                             "its log: logs/pretrain.log; run the same command again to resume"), out
    assert one_line_error(out)
    assert_one_line(out)


def test_stage_stops_when_snakemake_is_killed(tmp_path):
    """A stand-in `snakemake` starts a stage script and is killed with -9: the stage stops by itself
    (as on Ctrl-C, so training saves its checkpoint) and says to --unlock."""
    fake = tmp_path / "snakemake"
    child = textwrap.dedent(f"""
        import time
        from clgpt.stage import run_script
        def main():
            print("ready", flush=True)
            while True:
                time.sleep(0.05)
        run_script(main, None)
    """)
    fake.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen(["/bin/sh", "-c", 'exec "$0" -c "$1"', sys.executable, {child!r}])
        print(p.pid, flush=True)
        time.sleep(120)
    """))
    # the stage shares the stand-in's stdout and stderr: they end (EOF) when the stage has ended
    fake_proc = subprocess.Popen([sys.executable, str(fake)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=default_signals)
    child_pid = int(fake_proc.stdout.readline())
    assert fake_proc.stdout.readline() == "ready\n"  # the stage's watchdog runs: main() has started
    fake_proc.kill()
    try:
        _, text = fake_proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.kill(child_pid, signal.SIGKILL)
        fake_proc.communicate()
        raise AssertionError("the stage kept running after snakemake was killed") from None
    assert "snakemake --unlock" in text, text
    assert_one_line(text)


@pytest.mark.parametrize("sig, words", STOPS[1:], ids=["SIGTERM", "SIGHUP"])
def test_forward_stops_signals_the_stage_not_its_shell(tmp_path, sig, words):
    """A stand-in for Snakemake's process: its own SIGTERM handler (as Snakemake's scheduler sets it), then
    forward_stops (the workflow's onstart), then a job's shell running a stage script. The signal to the
    stand-in alone reaches the stage under the shell (the shell lives on to report the stage's status), the
    handler it replaced still runs, and with no stage running the stand-in says the one line itself."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "stage.py").write_text(textwrap.dedent("""
        import time
        from clgpt.stage import run_script
        def main():
            print("stage ready", flush=True)
            while True:
                time.sleep(0.05)
        run_script(main, None)
    """))
    standin = textwrap.dedent(f"""
        import signal, subprocess, sys, threading
        from clgpt.stage import forward_stops
        calls = threading.Semaphore(0)
        def graceful(signum, frame):
            print("graceful", flush=True)
            calls.release()
        signal.signal(signal.SIGTERM, graceful)
        forward_stops()
        shell = subprocess.Popen(["/bin/bash", "-c", f"{{sys.executable}} scripts/stage.py; echo shell-after=$?"])
        shell.wait()
        calls.acquire()
        print("idle", flush=True)
        calls.acquire()
    """)
    proc = subprocess.Popen([sys.executable, "-c", standin], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=default_signals)
    try:
        assert proc.stdout.readline() == "stage ready\n"  # in main(): the stage's handlers are in place
        proc.send_signal(sig)
        seen = [proc.stdout.readline() for _ in range(3)]
        assert sorted(seen) == ["graceful\n", "idle\n", f"shell-after={128 + sig}\n"] and seen[-1] == "idle\n", seen
        proc.send_signal(sig)  # no stage runs now
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == "graceful\n", out + err
    assert err.splitlines() == [f"error: {words}; run snakemake again to resume"] * 2, err


@pytest.mark.parametrize("sig, words, dispositions", [(*STOPS[1], default_signals), (*STOPS[2], default_signals),
                                                       (*STOPS[1], sigint_ignored)],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-background"])
def test_a_stop_signal_to_snakemake_alone_stops_the_stage(tmp_path, sig, words, dispositions):
    """`kill PID` of the snakemake process only (not its process group), or SIGHUP to it: the training stage
    saves the step it reached and stops at once (Snakemake alone would wait for every step), one line says
    so, and the next run plans pretrain again to resume (no lock left behind); also for a Snakemake started
    in the background (SIGINT ignored)."""
    with start_workflow(tmp_path, dispositions=dispositions) as run:
        run.wait_for("loss=")  # a step is done: training runs
        run.proc.send_signal(sig)
        run.proc.wait(300)  # a million steps take far longer: only a stop ends it in time
    out = run.output()
    assert run.proc.returncode != 0
    assert f"pretrain: {words}; saved step" in out, out
    assert out.rstrip().splitlines()[-1] == f"error: {words}; run snakemake again to resume", out
    assert_one_line(out)
    assert (run.path / "results/staging/pretrain/model.ckpt.partial").exists()
    assert "pretrain" in planned_rules(run.path)


def test_stale_lock_is_told_apart_from_a_live_one(tmp_path):
    locks = tmp_path / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    assert not stale_lock(tmp_path)
    (locks / "0.input.lock").write_text("")
    assert stale_lock(tmp_path)
    fake = tmp_path / "snakemake"  # a running snakemake working in that folder owns the lock
    fake.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(fake)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # it runs as `python .../snakemake`
        assert not stale_lock(tmp_path)
    finally:
        proc.kill()
        proc.wait()


def test_rerun_after_kill_9_says_unlock_first(tmp_path):
    """kill -9 of snakemake leaves its lock; the next run names `--unlock` (not Snakemake's
    --rerun-incomplete, which would fail on the lock), and --unlock itself still runs."""
    path = make_workdir(tmp_path / "wf", TINY)
    (path / ".snakemake" / "locks").mkdir(parents=True)
    (path / ".snakemake" / "locks" / "0.output.lock").write_text(str(path / "model.gguf") + "\n")
    r = snakemake(path, "-n", "model.gguf")
    assert r.returncode != 0
    assert "run `snakemake --unlock`, then the same snakemake command with --rerun-incomplete" in \
        one_line_error(r.stdout + r.stderr)
    assert snakemake(path, "--unlock").returncode == 0
    assert snakemake(path, "-n", "model.gguf").returncode == 0


# ---- the code each stage runs; the schema as the one source ----------------------------------------

@pytest.mark.parametrize("stage", ["train_tokenizer", "encode", "pretrain", "tune", "evaluate", "export"])
def test_code_inputs_cover_every_module_the_script_loads(stage):
    """The static import graph holds every package module that importing the script loads."""
    code = (f"import sys, runpy; runpy.run_path('scripts/{stage}.py', run_name='x'); "
            "print(' '.join(sorted(m for m in sys.modules if m == 'clgpt' or m.startswith('clgpt.'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    files = set(code_inputs(f"scripts/{stage}.py", ROOT))
    for module in r.stdout.split():
        parts = module.split(".")
        assert {f"{'/'.join(parts)}.py", f"{'/'.join(parts)}/__init__.py"} & files, (module, sorted(files))
    engine = stage in ("pretrain", "tune", "evaluate")
    assert ("clgpt/device/tuning.py" in files) == engine and ("kernels/matmul.cl" in files) == engine


def test_no_copies_of_the_defaults():
    """Settings and defaults live in the schema only: the stages fill theirs from it."""
    from clgpt.eval.evaluate import eval_settings
    from clgpt.training.train import stage_settings

    for module in ("training.train", "eval.evaluate"):
        assert not hasattr(__import__(f"clgpt.{module}", fromlist=["x"]), "DEFAULTS")
    for stage in ("pretrain", "tune"):
        s = stage_settings(stage, {})
        # AdamW, tuning auto, bucket 0 and label smoothing 0, the defaults, leave their keys out: settings and
        # checkpoints read as before Muon, the device tuner, bucketing and label smoothing existed
        assert defaults(stage)["optimizer"] == "adamw" and "optimizer" not in s and "muon" not in s
        assert defaults(stage)["tuning"] == "auto" and "tuning" not in s
        assert defaults(stage)["label_smoothing"] == 0 and "label_smoothing" not in s
        if "bucket" in defaults(stage):  # tune's random batches, the default, leave theirs out too
            assert defaults(stage)["bucket"] == 0 and "bucket" not in s
        plain = {k: v for k, v in defaults(stage).items()
                 if k not in ("optimizer", "muon", "tuning", "bucket", "label_smoothing")}
        assert {k: s[k] for k in plain} == plain
        assert stage_settings(stage, {"tuning": "off"})["tuning"] == "off"
        s = stage_settings(stage, {"optimizer": "muon"})
        assert s["optimizer"] == "muon" and s["muon"] == defaults(stage)["muon"]
    assert eval_settings({}) == defaults("evaluate")


def test_wheel_carries_kernels_and_schema(tmp_path):
    """`pip wheel .` outside the checkout: the wheel holds every package module (subpackages included),
    kernels/*.cl and the schema, and an install of it finds them with no checkout around; Snakemake's plugin
    registry lists its logger plugin `clgpt` (which profiles/default names)."""
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md", "clgpt", "kernels", "schemas", "snakemake_logger_plugin_clgpt"):
        (__import__("shutil").copytree if (ROOT / name).is_dir() else __import__("shutil").copy)(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp_path / "dist").glob("clgpt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {f"clgpt/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cl")}
    assert kernels <= names and "clgpt/schemas/config.schema.yaml" in names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "clgpt").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # a subpackage missing from pyproject's `packages`
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from clgpt.config import load_workflow_config, SCHEMA_PATH; from clgpt.paths import data_path; "
            "c = load_workflow_config('c.yaml'); print(SCHEMA_PATH, data_path('kernels'), c['tune']['lr'])")
    (tmp_path / "c.yaml").write_text("tune:\n  lr: 1e-3\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    schema, kernel_dir, lr = r.stdout.split()
    assert schema.startswith(str(site)) and kernel_dir == str(site / "clgpt" / "kernels") and float(lr) == 0.001
    code = ("from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry as R; "
            "import snakemake_logger_plugin_clgpt as p; print(R().is_installed('clgpt'), p.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0 and r.stdout.split() == ["True", str(site / "snakemake_logger_plugin_clgpt" / "__init__.py")], \
        r.stdout + r.stderr


# ---- training: the log across a resume, silent truncation, an unreachable vocabulary ----------------

def test_log_survives_a_resume_after_snakemake_deleted_it(tmp_path):
    """An interrupted stage leaves no log.csv (Snakemake would hold a half one against the next run); the resumed
    run still logs every step, and its elapsed time runs on from the interrupted run's."""
    from test_train import TINY as TRAIN_TINY, read_log, settings, stop_at, text_docs, write_encoded
    from clgpt.training.train import run_stage

    data = write_encoded(tmp_path / "pretrain.bin", text_docs())
    args = ("pretrain", data, settings(checkpoint_every=2), str(tmp_path / "model.ckpt"), str(tmp_path / "log.csv"))
    with pytest.raises(KeyboardInterrupt):
        run_stage(*args, model=TRAIN_TINY, callback=stop_at(5))
    assert not (tmp_path / "log.csv").exists()  # Ctrl-C leaves no half output; the rows wait beside the checkpoint
    before = read_log(tmp_path / "log.csv.partial")
    run_stage(*args, model=TRAIN_TINY)
    rows = read_log(tmp_path / "log.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows[:5]] == [r["loss"] for r in before]
    assert float(rows[-1]["elapsed_s"]) >= float(before[-1]["elapsed_s"])
    assert not (tmp_path / "log.csv.partial").exists() and not (tmp_path / "model.ckpt.partial").exists()


def test_dialog_longer_than_seq_len_is_named(tmp_path, capsys):
    from test_train import TINY as TRAIN_TINY, dialog_docs, settings, text_docs, write_encoded
    from clgpt.training.train import run_stage

    text = write_encoded(tmp_path / "pretrain.bin", text_docs())
    docs, pos = dialog_docs()
    dialogs = write_encoded(tmp_path / "tune.bin", docs, "dialog", pos)
    run_stage("pretrain", text, settings(steps=2), str(tmp_path / "pre.ckpt"), str(tmp_path / "pre.csv"), model=TRAIN_TINY)
    run_stage("tune", dialogs, settings(steps=2, seq_len=8), str(tmp_path / "t.ckpt"), str(tmp_path / "t.csv"),
              init_ckpt=str(tmp_path / "pre.ckpt"))
    longest = max(len(d) for d in docs)
    assert f"dialogs are longer than tune.seq_len=8 tokens (the longest {longest}) and are cut to it; " \
           "raise tune.seq_len" in capsys.readouterr().err


def test_unreachable_vocabulary_is_refused(tmp_path):
    import runpy

    main = runpy.run_path(str(ROOT / "scripts/train_tokenizer.py"))["main"]
    (tmp_path / "a.txt").write_text("ab ab ab\n")
    (tmp_path / "a.jsonl").write_text('{"user": "ab", "assistant": "ab"}\n')
    with pytest.raises(ClgptError, match=r"tokenizer.vocab_size=65536 cannot be reached: the corpus has pairs for "
                                         r"only \d+ tokens; set tokenizer.vocab_size to \d+ or less"):
        main([str(tmp_path / "a.txt")], [str(tmp_path / "a.jsonl")], 65536, "line", None, str(tmp_path / "t.json"),
             str(tmp_path / "v.txt"))
    assert not (tmp_path / "t.json").exists()

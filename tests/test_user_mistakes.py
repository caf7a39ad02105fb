"""The mistakes users make next, each answered by one clgpt line that names the file or key and what to do
(or a `warning:` line for data the stages would drop without a word), and `clgpt run KEY=VALUE` for the
dotted --config keys Snakemake's own parser refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from snakemake.cli import parse_config

from clgpt.config import load_schema, load_workflow_config
from clgpt.errors import ClgptError
from clgpt.runner import snakemake_args
from test_errors import assert_one_line, one_line_error
from test_pipeline import TINY, make_workdir, snakemake, write_config

ROOT = Path(__file__).resolve().parent.parent


def clgpt(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "clgpt", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---- ranks, at parse time; clgpt run ------------------------------------------------------------------

def test_ranks_above_batch_size_stops_the_dry_run_with_one_line(tmp_path):
    config = json.loads(json.dumps(TINY))
    config["pretrain"].update(ranks=3, batch_size=2)
    path = make_workdir(tmp_path / "wf", config)
    r = snakemake(path, "-n", "model.gguf")
    assert r.returncode != 0
    line = one_line_error(r.stdout + r.stderr)
    assert "config.yaml:" in line and "pretrain.ranks=3 is more than pretrain.batch_size=2" in line, line


def test_clgpt_run_passes_dotted_keys_to_snakemake(tmp_path):
    """`clgpt run pretrain.ranks=3 ...` reaches the config as --config would (the error names --config),
    and a dry run with good values plans the stages."""
    path = make_workdir(tmp_path / "wf")
    r = clgpt("run", "pretrain.ranks=3", "pretrain.batch_size=2", "-n", "--cores", "1", "model.gguf", cwd=path)
    assert r.returncode != 0
    assert "--config: pretrain.ranks: pretrain.ranks=3 is more than" in one_line_error(r.stdout + r.stderr)
    r = clgpt("run", "pretrain.steps=100", "tune.lr=1e-3", "-n", "--cores", "1", "model.gguf", cwd=path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pretrain" in r.stdout + r.stderr


def test_snakemake_args_groups_dotted_keys_by_section():
    args = snakemake_args(["pretrain.steps=100", "--cores", "1", "model.gguf", "tune.lr=1e-3", "pretrain.lr=2e-3",
                           "device=1:0", "resources.pretrain.threads=2", "export.name=my model, v2"])
    assert args[:4] == ["--cores", "1", "model.gguf", "--config"]
    parsed = parse_config(args[4:])  # Snakemake's own --config parser
    assert parsed == {"pretrain": {"steps": "100", "lr": "2e-3"}, "tune": {"lr": "1e-3"}, "device": "1:0",
                      "resources": {"pretrain": {"threads": "2"}}, "export": {"name": "my model, v2"}}
    cfg = load_workflow_config(str(ROOT / "config.yaml"), (), parsed)
    assert cfg["pretrain"]["steps"] == 100 and cfg["tune"]["lr"] == 0.001 and cfg["device"] == "1:0"
    with pytest.raises(ClgptError, match=r"^pretrian.steps=3: unknown key 'pretrian'; did you mean 'pretrain'\?"):
        snakemake_args(["pretrian.steps=3"])


def test_a_key_without_a_value_is_one_line_not_snakemakes_usage():
    """`clgpt run pretrain.steps -n ...` would reach Snakemake as a target and print its 100-line usage."""
    with pytest.raises(ClgptError, match=r"^pretrain.steps: a config key without a value; write pretrain.steps=VALUE$"):
        snakemake_args(["pretrain.steps", "-n", "--cores", "1", "model.gguf"])
    assert snakemake_args(["model.gguf", "-n"]) == ["model.gguf", "-n"]  # a target that looks like a key is kept


@pytest.mark.parametrize("args, message", [
    (["--configfile", "missing.yaml"], "error: --configfile missing.yaml: config file not found; check the name"),
    (["--configfile=data"], "error: --configfile data: is a folder; give the config YAML file"),
    (["--configfile", "config.yaml", "bad.yaml"], "error: --configfile bad.yaml:2:1: not valid YAML"),
], ids=["missing", "folder", "second-not-yaml"])
def test_clgpt_run_names_a_configfile_snakemake_cannot_read(tmp_path, args, message):
    """Snakemake reads each --configfile before the workflow runs, and a missing or broken one is its
    traceback; `clgpt run` names it in one line first."""
    path = make_workdir(tmp_path / "wf")
    (path / "bad.yaml").write_text("model: [1,\n")
    r = clgpt("run", "-n", "--cores", "1", "model.gguf", *args, cwd=path)
    assert r.returncode == 1
    assert one_line_error(r.stdout + r.stderr).startswith(message), r.stderr


@pytest.mark.parametrize("value, ok", [("100", True), ("abc", False)])
def test_clgpt_run_takes_a_dotted_key_after_config(tmp_path, value, ok):
    """`--config pretrain.steps=100`, refused by Snakemake's own parser with a traceback, works through
    `clgpt run`; a bad value is one line naming the key."""
    path = make_workdir(tmp_path / "wf")
    r = clgpt("run", "-n", "--cores", "1", "model.gguf", "--config", f"pretrain.steps={value}", cwd=path)
    if ok:
        assert r.returncode == 0 and "pretrain" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
        assert_one_line(r.stdout + r.stderr)
    else:
        assert r.returncode != 0
        assert "pretrain.steps: 'abc' is not a number" in one_line_error(r.stdout + r.stderr)


# ---- the property: random --config overrides, through Snakemake's parser, at the loader -------------

def _leaf_keys():
    keys = []
    for section, sub in load_schema()["properties"].items():
        keys += [f"{section}.{k}" for k in sub.get("properties", {})] or [section]
    return keys


TEXT = st.one_of(st.sampled_from(["1e-3", "0", "-1", "3.0", "yes", "true", "null", "1:0", "", "[1, 2]", "{a: 1}",
                                  "q4_0", "llama", "data/none", "nan", ".inf", "1e999", "'x'", '"', "{", "a, b"]),
                 st.text(max_size=8), st.integers(-10**9, 10**9).map(str))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.one_of(st.sampled_from(_leaf_keys()),
                                    st.from_regex(r"[a-z]{2,6}(\.[a-z_]{1,6}){0,2}", fullmatch=True)), TEXT),
                min_size=1, max_size=4))
@example([("aa", "\n")])  # an unknown key whose value holds a newline: the error is still one line
def test_any_config_override_validates_or_names_a_key(overrides):
    """KEY=VALUE overrides as `clgpt run` passes them and Snakemake parses them: the loader returns a config
    or gives one line naming a key; nothing else escapes."""
    args = [f"{k}={v}" for k, v in overrides]
    try:
        config_args = snakemake_args(args)[1:]
    except ClgptError as e:
        assert "\n" not in str(e) and any(a.split("=")[0].split(".")[0] in str(e) for a in args), str(e)
        return
    try:
        load_workflow_config(str(ROOT / "config.yaml"), (), parse_config(config_args))
    except ClgptError as e:
        msg = str(e)
        assert "\n" not in msg
        named = {k for k, _ in overrides} | {k.split(".")[0] for k, _ in overrides}
        named |= {"model", "tokenizer", "pretrain", "tune", "export", "corpus", "device", "OpenCL"}
        assert any(key in msg for key in named), msg


# ---- generate --chat FILE.json -------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from clgpt.io.gguf import export_gguf
    from clgpt.model import ModelConfig, init_params
    from clgpt.text.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("gen")
    tok = Tokenizer.train(["The cat sat on the mat.", "Water boils at one hundred degrees."], 280)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    export_gguf(str(d / "m.gguf"), cfg, init_params(cfg, seed=1), tok)
    return d / "m.gguf"


def test_generate_with_a_missing_chat_file_names_it(gguf, tmp_path):
    r = clgpt("generate", str(gguf), "--chat", "conversaton.json", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert "--chat conversaton.json: no such file" in one_line_error(r.stderr)


# ---- data dropped without a word: one warning line each ----------------------------------------------

def warnings_of(capsys) -> list[str]:
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("warning: ") for line in lines), lines
    return lines


def corpus(tmp_path: Path, **extra) -> dict:
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "a.txt").write_text("The other day the cat sat.\n")
    return {"pretrain": str(tmp_path / "pre"), "tune": None, "document": "file", "separator": None, **extra}


def test_parquet_rows_without_text_are_counted(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from clgpt.data.preflight import check_corpus

    c = corpus(tmp_path)
    texts = [None if i % 3 == 0 else f"row {i}" for i in range(134)]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), tmp_path / "pre" / "b.parquet")
    check_corpus(c)
    nulls = sum(t is None for t in texts)
    assert warnings_of(capsys) == [f"warning: {tmp_path / 'pre' / 'b.parquet'}: {nulls} of 134 rows have no text "
                                   "(null in column 'text') and are skipped"]


def test_upper_case_suffix_and_dangling_link_are_named(tmp_path, capsys):
    from clgpt.data.preflight import check_corpus

    c = corpus(tmp_path)
    (tmp_path / "pre" / "B.TXT").write_text("shouting\n")
    (tmp_path / "pre" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    files = check_corpus(c)["pretrain"]
    assert files == [str(tmp_path / "pre" / "a.txt")]
    lines = warnings_of(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"warning: {tmp_path / 'pre'}: 1 file(s) skipped because their suffix is not "
                               "written in lower case (B.TXT)")
    assert lines[1].startswith(f"warning: {tmp_path / 'pre'}: 1 link(s) to a file that does not exist skipped "
                               f"(gone.txt -> {tmp_path / 'nowhere.txt'})")


def test_separator_inside_words_is_counted(tmp_path, capsys):
    from clgpt.data.preflight import check_corpus

    check_corpus(corpus(tmp_path, separator="the"))  # "The other day the cat": inside "other" only
    lines = warnings_of(capsys)
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: {tmp_path / 'pre' / 'a.txt'}: corpus.separator 'the' occurs inside words 1 time(s), e.g. "), lines
    (tmp_path / "other").mkdir()
    check_corpus(corpus(tmp_path / "other", separator="<|end|>"))  # no word character at either end
    assert warnings_of(capsys) == []


# ---- the smaller ones ---------------------------------------------------------------------------

def test_a_number_where_text_goes_is_called_a_number():
    from clgpt.text.chat import parse_dialog_line

    with pytest.raises(ClgptError, match=r'^f.jsonl:3: "user" is a number \(42\), not text; write it as a string in '
                                         r'quotes: "user": "42"$'):
        parse_dialog_line({"user": 42, "assistant": "Hi"}, "f.jsonl:3")
    with pytest.raises(ClgptError, match=r'^f.jsonl:4: message 2: "content" is a list \(\[1\]\), not text'):
        parse_dialog_line({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [1]}]},
                          "f.jsonl:4")


def test_openai_name_and_weight_are_read_and_ignored():
    from clgpt.text.chat import parse_dialog_line

    d = parse_dialog_line({"messages": [{"role": "user", "content": "Hi", "name": "ann"},
                                        {"role": "assistant", "content": "Hello", "weight": 0}]}, "f:1")
    assert d["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_corpus_path_that_is_a_file_lists_the_suffixes(tmp_path):
    from clgpt.data.preflight import check_corpus

    c = corpus(tmp_path)
    with pytest.raises(ClgptError) as e:
        check_corpus({**c, "pretrain": str(tmp_path / "pre" / "a.txt")})
    assert "holds the *.txt, *.jsonl or *.parquet files" in str(e.value) and "('.txt'" not in str(e.value)


def test_model_shape_error_points_at_the_keys_line(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("model:\n  arch: llama\n  n_embd: 32\n  n_head: 2\n  n_head_kv: 3\n")
    with pytest.raises(ClgptError, match=rf"^{p}:5: model.n_head_kv: 3 must divide n_head=2"):
        load_workflow_config(str(p))


def test_pyopencl_ctx_is_named_when_it_matches_no_device(monkeypatch):
    from clgpt.device.opencl import get_device

    monkeypatch.setenv("PYOPENCL_CTX", "5")
    with pytest.raises(ClgptError, match=r"^PYOPENCL_CTX='5' names no OpenCL device; .*unset PYOPENCL_CTX"):
        get_device(None)


def test_sweeping_ranks_says_it_cannot_be_swept():
    from clgpt.training.sweep import check_sweep

    with pytest.raises(ClgptError, match=r"sweep.pretrain.ranks cannot be swept"):
        check_sweep({"pretrain.ranks": [1, 2]})
    with pytest.raises(ClgptError, match=r"unknown sweep key 'sweep.pretrain.rank'"):
        check_sweep({"pretrain.rank": [1, 2]})


def test_truncated_checkpoint_says_to_force_the_stage(tmp_path):
    from clgpt.io.checkpoint import load_checkpoint, save_checkpoint
    from clgpt.model import ModelConfig, init_params

    cfg = ModelConfig(vocab_size=260, n_ctx=16, n_embd=8, n_head=2, n_layer=1, n_ff=16)
    path = tmp_path / "results" / "tune" / "model.ckpt"
    save_checkpoint(str(path), cfg, init_params(cfg, seed=0), {}, 3, {})
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(ClgptError, match=r"not a readable clgpt checkpoint .*snakemake --cores 1 --forcerun tune "
                                         r"model.gguf$"):
        load_checkpoint(str(path))


def test_a_reply_cut_inside_a_character_leaves_the_character_out():
    from clgpt.text.tokenizer import Tokenizer

    tok = Tokenizer.train(["abc"], 260)  # byte-level: "é" is two tokens
    ids = tok.encode("caf\u00e9")
    assert len(ids) == 5 and tok.decode(ids[:4]) == "caf\ufffd"
    assert tok.decode(ids[:4], final=False) == "caf" and tok.decode(ids, final=False) == "caf\u00e9"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from(["pretrain.steps=100", "a=1", "device=", "=x", "x", "pretrain={steps: 1}", "a-b=1",
                                  "ab-=1", "_x=1", "é=1"]),
                 st.text(alphabet="ab._-=1 {}:", max_size=10)))
def test_refused_by_snakemake_agrees_with_snakemakes_parser(entry):
    """clgpt's line for a --config entry comes exactly when Snakemake's own parser refuses the entry."""
    from clgpt.runner import refused_by_snakemake

    assume(entry == "-" or not entry.startswith("-"))  # argparse takes any other "-..." for an option
    try:
        parse_config([entry])
        refused = False
    except ValueError:
        refused = True
    line = refused_by_snakemake(["-n", "--config", entry])
    assert (line is not None) == refused, (entry, line)
    assert line is None or (line.startswith("--config ") and "\n" not in line)


# ---- plain `snakemake` after the README's `pip install -e .`: Snakemake's argument mistakes ----------

@pytest.fixture(scope="module")
def editable_install(tmp_path_factory):
    """(a copy of the workflow, installed as the README says: `pip install -e .` into a fresh environment, and
    that environment's `snakemake` command). The environment sees the machine's packages but not this
    checkout's PYTHONPATH, so Snakemake finds the logger plugin only through the install."""
    import shutil

    tmp = tmp_path_factory.mktemp("editable")
    work = make_workdir(tmp / "wf")
    for name in ("pyproject.toml", "setup.cfg", "README.md", "profiles", "snakemake_logger_plugin_clgpt"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, work / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(work)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    command = venv / "bin" / "snakemake"  # what pip writes for Snakemake's console script
    command.write_text(f"#!{python}\nimport sys\nfrom snakemake.cli import main\nsys.exit(main())\n")
    command.chmod(0o755)
    return work, command


@pytest.mark.parametrize("args, message", [
    (["--configfile", "missing.yaml"], "error: --configfile missing.yaml: config file not found"),
    (["--config", "pretrain.steps=100"], "error: --config pretrain.steps=100: Snakemake takes no dotted keys; use "
                                         "clgpt run pretrain.steps=100 (with the rest of the command) or "
                                         "--config 'pretrain={steps: 100}'"),
    (["--config", "pretrain.steps=abc"], "error: --config pretrain.steps=abc: Snakemake takes no dotted keys"),
], ids=["missing-configfile", "dotted-key", "dotted-key-bad-value"])
def test_plain_snakemake_names_an_argument_it_refuses(editable_install, args, message):
    """Snakemake reads --configfile and --config before the Snakefile runs, and refuses a missing file or a dotted
    key with a traceback; the workflow's profile names clgpt's logger plugin, which says clgpt's line instead."""
    work, command = editable_install
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(command), "-n", "--cores", "1", "model.gguf", *args], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert one_line_error(r.stdout + r.stderr).startswith(message), r.stdout + r.stderr
    r = subprocess.run([str(command), "-n", "--cores", "1", "model.gguf"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "pretrain" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


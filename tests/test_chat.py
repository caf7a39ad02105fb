"""The chat format (ChatML): clgpt's encoding, the GGUF's Jinja template, the Ollama Modelfile template and
llama.cpp's built-in template engine render the same tokens for multi-turn conversations with a system
prompt; `<|im_end|>` ends a turn everywhere; a small model trained on conversations answers, through both
of llama.cpp's chat paths, after a system prompt and in the 2nd and 3rd turn (bench/llama_exact_match.py
measures the same on the default model).

llama_cpp is a test dependency (pyproject [test]); when it is missing these tests fail, not skip.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jinja2.sandbox
import llama_cpp
import pytest

from clgpt.text.chat import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    OLLAMA_TEMPLATE,
    chat_probes,
    check_messages,
    heldout_systems,
    system_probes,
    encode_chat,
    encode_prompt,
)
from clgpt.cli import chat_messages
from clgpt.errors import ClgptError
from clgpt.io.gguf import export_gguf
from clgpt.model import ModelConfig, init_params
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import pad_dialogs
from clgpt.device.knobs import Knobs

from gotemplate import render as go_render

ROOT = Path(__file__).resolve().parent.parent
N_CTX = 256

CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Where is the cat?"},
     {"role": "assistant", "content": "The cat sat on the mat."},
     {"role": "user", "content": "And the dog?"},
     {"role": "assistant", "content": "The dog sat on the log."},
     {"role": "user", "content": "Скажи привет!"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, it is nice to meet you!"},
     {"role": "user", "content": "  spaces  and\nnewlines\n\n"}],
    [{"role": "system", "content": "Отвечай коротко.\nWith two lines."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "One question 🙂"}],
]


def jinja_render(messages, add_generation_prompt=True, bos="<s>") -> str:
    """The GGUF template as Hugging Face and llama-cpp-python render it (sandboxed Jinja2)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=bos, eos_token=IM_END)


def ollama_render(messages) -> str:
    """The Modelfile template with the data Ollama gives it: .System holds the system messages' text and
    .Messages every message (Ollama keeps the system ones there too)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [{"Role": m["role"], "Content": m["content"]} for m in messages]  # Ollama's api.Message fields
    return go_render(OLLAMA_TEMPLATE, {"System": system, "Messages": turns})


def tokenize_rendered(tok, text: str) -> list[int]:
    """What llama.cpp does with a rendered prompt (special=True): split on the special tokens' names,
    BPE each piece between them."""
    specials = {"<s>": tok.bos_id, "</s>": tok.eos_id, IM_START: tok.im_start_id, IM_END: tok.im_end_id}
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        ids += [specials[piece]] if piece in specials else tok.encode(piece)
    return ids


@pytest.fixture(scope="module")
def tok():
    texts = [m["content"] for c in CONVERSATIONS for m in c] + ["user\nassistant\nsystem\n"] * 3
    return Tokenizer.train(texts, 340)


# ---- the three renderings ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_clgpt_jinja_and_ollama_render_the_same_tokens(tok, k):
    messages = CONVERSATIONS[k]
    ours = encode_prompt(tok, messages)
    text = jinja_render(messages)
    assert tokenize_rendered(tok, text) == ours
    assert text.startswith("<s><|im_start|>") and text.endswith("<|im_start|>assistant\n")
    # Ollama renders no BOS (it adds BOS from the tokenizer, tokenizer.ggml.add_bos_token)
    assert [tok.bos_id, *tokenize_rendered(tok, ollama_render(messages))] == ours


def test_full_conversation_jinja_matches_training_ids(tok):
    messages = CONVERSATIONS[0][:5]
    ids, spans = encode_chat(tok, messages)
    assert tokenize_rendered(tok, jinja_render(messages, add_generation_prompt=False)) == ids
    counted = [ids[j + 1] for a, b in spans for j in range(a, b)]
    assert tok.decode(counted) == "The cat sat on the mat.<|im_end|>The dog sat on the log.<|im_end|>"


def test_ollama_template_without_system_prompt(tok):
    messages = CONVERSATIONS[1]
    assert ollama_render(messages) == jinja_render(messages)[len("<s>"):]
    assert "system" not in ollama_render(messages)


def test_modelfile_stops_at_end_of_turn(tmp_path):
    from clgpt.io.gguf import write_modelfile

    write_modelfile(str(tmp_path / "Modelfile"), "model.gguf", ModelConfig(n_ctx=256))
    text = (tmp_path / "Modelfile").read_text()
    assert f'TEMPLATE """{OLLAMA_TEMPLATE}"""' in text and 'PARAMETER stop "<|im_end|>"' in text


# ---- bad conversations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, prompt, message",
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True, "message 2: two user messages in a row"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], True, "must end on a user turn"),
        ([{"role": "user", "content": "a"}], False, "ends on a user turn"),
        ([{"role": "tool", "content": "a"}], True, "message 1: unknown role 'tool'"),
        ([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
         True, "message 2: a system message may only come first"),
        ([{"role": "user", "content": ""}], True, 'message 1: missing or empty "content"'),
        ("hello", True, "non-empty list"),
    ],
)
def test_bad_conversations_are_one_line_errors(messages, prompt, message):
    with pytest.raises(ClgptError) as e:
        check_messages(messages, "chat.json", prompt=prompt)
    assert str(e.value).startswith("chat.json") and message in str(e.value) and "\n" not in str(e.value)


def test_generate_chat_conversation_from_flags_and_file(tmp_path):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}]
    assert chat_messages("How are you?", turns) == [*turns, {"role": "user", "content": "How are you?"}]
    f = tmp_path / "chat.json"
    f.write_text(json.dumps({"messages": [*turns, {"role": "user", "content": "More?"}]}))
    assert chat_messages(str(f), [])[-1] == {"role": "user", "content": "More?"}
    f.write_text(json.dumps(turns))
    with pytest.raises(ClgptError, match=r"chat.json: the conversation must end on a user turn"):
        chat_messages(str(f), [])


def test_chat_probes_ask_every_pair_three_ways():
    pairs = [("q1", "a1"), ("q2", "a2"), ("q3", "a3")]
    probes = chat_probes(pairs, ["S"])
    assert [p[0] for p in probes] == ["system", "turn2", "turn3"] * 3
    kind, opening, questions, expected = probes[2]
    assert opening == [] and questions == ["q2", "q3", "q1"] and expected == "a1"
    assert probes[0][1] == [{"role": "system", "content": "S"}]



def test_system_probes_ask_every_pair_after_a_system_prompt_first_and_later():
    pairs = [("q1", "a1"), ("q2", "a2"), ("q3", "a3")]
    probes = system_probes(pairs, ["S", "T"])
    assert [(p[0], p[1][0]["content"], p[2], p[3]) for p in probes] == [
        ("first", "S", ["q1"], "a1"), ("later", "S", ["q2", "q1"], "a1"),
        ("first", "T", ["q2"], "a2"), ("later", "T", ["q3", "q1", "q2"], "a2"),
        ("first", "S", ["q3"], "a3"), ("later", "S", ["q1", "q3"], "a3")]


def test_heldout_systems_are_the_ones_no_tune_dialog_uses():
    def dialog(system):
        return {"messages": ([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}

    tune = [dialog("A"), dialog(None), dialog("B")]
    heldout = [dialog("C"), dialog("A"), dialog(None), dialog("D"), dialog("C")]
    assert heldout_systems(tune, heldout) == ["C", "D"]
    assert heldout_systems(tune, tune) == []


def test_bench_asks_tune_questions_after_the_heldout_files_own_system_prompts(bench, tmp_path):
    tune, heldout = tmp_path / "tune.jsonl", tmp_path / "heldout.jsonl"
    tune.write_text("".join(json.dumps({"user": q, "assistant": a}) + "\n" for q, a in PAIRS[:3])
                    + json.dumps({"messages": [{"role": "system", "content": "Trained."},
                                               {"role": "user", "content": PAIRS[0][0]},
                                               {"role": "assistant", "content": PAIRS[0][1]}]}) + "\n")
    paragraph = " ".join(["word"] * 25)
    heldout.write_text("".join(json.dumps({"messages": [{"role": "system", "content": s},
                                                         {"role": "user", "content": "New?"},
                                                         {"role": "assistant", "content": "Yes."}]}) + "\n"
                               for s in ("Trained.", "Short.", paragraph)))
    probes = bench.heldout_system_probes([str(tune)], str(heldout))
    assert [(kind, opening[0]["content"], expected) for kind, opening, _, expected in probes] == [
        ("line first", "Short.", PAIRS[0][1]), ("line later", "Short.", PAIRS[0][1]),
        ("paragraph first", paragraph, PAIRS[1][1]), ("paragraph later", paragraph, PAIRS[1][1]),
        ("line first", "Short.", PAIRS[2][1]), ("line later", "Short.", PAIRS[2][1])]
    with pytest.raises(SystemExit, match="no system prompt that the tune dialogs do not use"):
        bench.heldout_system_probes([str(tune)], str(tune))
    # --ask: only the questions of the named files, the system prompts still from all of them
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"user": PAIRS[3][0], "assistant": PAIRS[3][1]}) + "\n")
    asked = bench.heldout_system_probes([str(tune), str(extra)], str(heldout), ask=[str(extra)])
    assert [(kind, expected) for kind, _, _, expected in asked] == [("line first", PAIRS[3][1])]
    assert {q for _, _, questions, _ in bench.corpus_probes([str(tune), str(extra)], ask=[str(tune)])
            for q in questions[-1:]} == {q for q, _ in PAIRS[:3]}


# ---- llama.cpp ------------------------------------------------------------------------------------

PAIRS = [
    ("Where is the cat?", "The cat sat on the mat."),
    ("Where is the dog?", "The dog sat on the log."),
    ("What flies?", "Birds fly over the sea."),
    ("Say hello", "Привет, мир!"),
    ("Count", "One, two, three."),
    ("What is red?", "A ripe tomato is red."),
]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly."]


def training_conversations() -> list[list[dict]]:
    """Every pair alone, and the probe conversations (chat_probes) with their expected replies. The model
    memorises these: this test checks that llama.cpp's two chat paths reproduce what clgpt trained, while
    answering new combinations of turns is measured on the default model (bench/llama_exact_match.py)."""
    out = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in PAIRS]
    answer = dict(PAIRS)
    for _, opening, questions, _ in chat_probes(PAIRS, SYSTEMS):
        out.append([*opening, *[m for q in questions for m in ({"role": "user", "content": q},
                                                               {"role": "assistant", "content": answer[q]})]])
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A 2-layer model trained on the conversations above (full batch, AdamW), as GGUF."""
    from clgpt.models.factory import make_engine

    convs = training_conversations()
    texts = [f"{m['role']}\n{m['content']}" for c in convs for m in c]
    tok = Tokenizer.train(texts, 360)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=N_CTX, n_embd=64, n_head=2, n_layer=2, n_ff=128)
    tokens, targets, mask, _ = pad_dialogs([encode_chat(tok, c) for c in convs], N_CTX)
    eng = make_engine(cfg, init_params(cfg, 0), batch_size=tokens.shape[0], seq_len=tokens.shape[1], knobs=Knobs())
    for _ in range(120):
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-2, weight_decay=0.0)
    assert loss < 0.05, f"the chat model did not learn (loss {loss:.3f})"
    path = str(tmp_path_factory.mktemp("chat") / "chat.gguf")
    export_gguf(path, cfg, eng.get_params(), tok, ftype="f32", name="clgpt-chat")
    return tok, path


@pytest.fixture(scope="module")
def llm(chat_model):
    return llama_cpp.Llama(model_path=chat_model[1], n_ctx=N_CTX, verbose=False, seed=0)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("llama_exact_match", ROOT / "bench" / "llama_exact_match.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_end_of_turn_is_eos_and_eot(chat_model, llm):
    tok = chat_model[0]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llm.token_eos() == tok.im_end_id
    assert llama_cpp.llama_vocab_eot(vocab) == tok.im_end_id
    assert llama_cpp.llama_vocab_is_eog(vocab, tok.im_end_id) and llama_cpp.llama_vocab_is_eog(vocab, tok.eos_id)
    assert not llama_cpp.llama_vocab_is_eog(vocab, tok.im_start_id)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_llama_cpp_renders_and_tokenizes_like_clgpt(chat_model, llm, bench, k):
    """llama.cpp's built-in engine recognises the GGUF template as ChatML (no Jinja), and llama.cpp's
    tokenizer turns the Jinja rendering into clgpt's ids."""
    tok = chat_model[0]
    messages = CONVERSATIONS[k]
    ours = encode_prompt(tok, messages)
    template = llm.metadata["tokenizer.chat_template"].encode()
    assert template.decode() == CHAT_TEMPLATE
    builtin = bench.builtin_prompt(llm, messages, template)
    assert builtin.decode() == jinja_render(messages)[len("<s>"):]
    assert llm.tokenize(builtin, add_bos=True, special=True) == ours
    assert llm.tokenize(jinja_render(messages).encode(), add_bos=False, special=True) == ours


def test_create_chat_completion_evaluates_clgpt_prompt(chat_model, llm):
    tok = chat_model[0]
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": PAIRS[0][0]},
                {"role": "assistant", "content": PAIRS[0][1]}, {"role": "user", "content": PAIRS[1][0]}]
    r = llm.create_chat_completion(messages=messages, temperature=0.0, repeat_penalty=1.0, max_tokens=40)
    prompt = encode_prompt(tok, messages)
    assert [int(t) for t in llm.input_ids[: len(prompt)]] == prompt
    # a trained conversation (chat_probes' 2nd-turn one for pair 0): the reply, then a stop at <|im_end|>
    messages = [{"role": "user", "content": PAIRS[1][0]}, {"role": "assistant", "content": PAIRS[1][1]},
                {"role": "user", "content": PAIRS[0][0]}]
    r = llm.create_chat_completion(messages=messages, temperature=0.0, repeat_penalty=1.0, max_tokens=40)
    assert r["choices"][0]["message"]["content"] == PAIRS[0][1]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_answers_after_system_prompt_and_in_later_turns_in_both_llama_paths(chat_model, bench):
    """The issue's bar: at least 90% word for word for each kind of turn, through Jinja
    (create_chat_completion) and through llama.cpp's built-in template engine."""
    probes = chat_probes(PAIRS, SYSTEMS)
    results = bench.run_probes(chat_model[1], probes, max_tokens=40)
    for path, rows in results.items():
        for kind, (hits, total) in bench.rates(rows).items():
            assert total == len(PAIRS) and hits >= 0.9 * total, (path, kind, hits, total, rows)

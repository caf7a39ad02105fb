"""The chat format, in one place: ChatML. The tune stage trains on it, `clgpt generate --chat` and the
evaluation prompt with it, the GGUF carries it as a Jinja template and the Ollama Modelfile as a Go template.

A conversation is BOS, then one block per message, system first if there is one:

    <s><|im_start|>system\\n{text}<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n{text}<|im_end|>\\n

`<|im_start|>` and `<|im_end|>` are special tokens; `role\\n{text}` between them is ordinary text, encoded
as one piece exactly as llama.cpp tokenizes a rendered template (it splits on special tokens, then runs
the BPE on each piece between them). A prompt ends with `<|im_start|>assistant\\n`, so the model writes the
reply and then `<|im_end|>`, the end-of-turn token (the GGUF's EOS and EOT, so every client stops there).
The loss covers each assistant turn's text and its `<|im_end|>`, and nothing else.

ChatML is the format llama.cpp's built-in template engine recognises by the `<|im_start|>` marker
(`llama_chat_apply_template`, `llama-cli`, `llama-server --no-jinja`), so clients work with or without Jinja.
BOS: the Jinja template starts with `{{ bos_token }}` because llama-cpp-python tokenizes a rendered chat
prompt without adding BOS; llama.cpp's own chat code strips a leading BOS from the rendered text and adds
it through `tokenizer.ggml.add_bos_token` (true), and its built-in ChatML renders no BOS at all. Ollama's
Go template has no BOS: Ollama adds it from the tokenizer. Every path therefore sees exactly one `<s>`.

Conversations: a list of {"role": "system"|"user"|"assistant", "content": str}; an optional system
message first, then user and assistant alternating from a user turn. `check_messages` enforces that.
"""

from __future__ import annotations

from clgpt.errors import ClgptError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant")

# Hugging Face / llama.cpp ChatML, with BOS first (see the module docstring).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Ollama's Go template: .System is the system prompt (a Modelfile SYSTEM or the request's system
# message), .Messages the turns without it. Rendered text is the same as CHAT_TEMPLATE's without BOS.
OLLAMA_TEMPLATE = (
    "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    '{{- range .Messages }}{{- if ne .Role "system" }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
    "{{- end }}<|im_start|>assistant\n"
)


# OpenAI fine-tuning files may give a message a "name" (the speaker) and an assistant message a "weight"
# (0: not trained on). The chat format has no place for a name, and every assistant turn is trained on.
IGNORED_FIELDS = ("name", "weight")


def _kind(value) -> str:
    if isinstance(value, bool):
        return "true or false"
    return {int: "a number", float: "a number", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _json(value) -> str:
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def check_messages(messages, where: str, *, prompt: bool = False) -> list[dict]:
    """`messages` as a list of {"role", "content"} dicts, or a one-line ClgptError starting with `where`.

    Order: an optional system message first, then user, assistant, user, ... A training dialog
    (prompt=False) ends on an assistant turn; a prompt (prompt=True) ends on a user turn.
    """
    if not isinstance(messages, list) or not messages:
        raise ClgptError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects')
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: message {i + 1}"
        if not isinstance(m, dict):
            raise ClgptError(f'{at} is not an object; write {{"role": "user", "content": "..."}}')
        extra = sorted(set(m) - {"role", "content", *IGNORED_FIELDS})
        if extra:
            raise ClgptError(f'{at}: unknown field {extra[0]!r}; only "role" and "content" are allowed '
                             f'({" and ".join(map(repr, IGNORED_FIELDS))} are read and ignored)')
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ClgptError(f"{at}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        if content is not None and not isinstance(content, str):
            raise ClgptError(f'{at}: "content" is {_kind(content)} ({_json(content)}), not text; write it as a string '
                             'in quotes')
        if not isinstance(content, str) or not content.strip():
            raise ClgptError(f'{at}: missing or empty "content" ({role}); every message needs text')
        if IM_START in content or IM_END in content:
            raise ClgptError(f"{at}: content holds a chat marker ({IM_START} or {IM_END}); remove it")
        if role == "system":
            if i != 0:
                raise ClgptError(f"{at}: a system message may only come first")
        else:
            first_turn = 1 if messages[0].get("role") == "system" else 0
            expected = "user" if (i - first_turn) % 2 == 0 else "assistant"
            if role != expected:
                prev = messages[i - 1].get("role") if i else None
                why = f"two {role} messages in a row" if prev == role else "the conversation must start with a user turn"
                raise ClgptError(f"{at}: {why}; user and assistant turns alternate, starting with user")
        out.append({"role": role, "content": content})
    last = out[-1]["role"]
    if prompt and last != "user":
        raise ClgptError(f"{where}: the conversation must end on a user turn for the model to answer, not {last}")
    if not prompt and last != "assistant":
        raise ClgptError(f"{where}: the conversation ends on a {last} turn; a training dialog ends with the assistant's reply")
    return out


def _block(tok, role: str, content: str) -> tuple[list[int], int]:
    """Ids of `<|im_start|>role\\n{content}<|im_end|>` and the index of the first content token."""
    head = tok.encode(f"{role}\n")
    body = tok.encode(f"{role}\n{content}")
    if role == "assistant" and body[: len(head)] != head:
        # a leading space or newline of the reply merged with the "\n" after the role: the prompt
        # `<|im_start|>assistant\n` would not be a prefix of the training tokens
        raise ClgptError(f"the assistant's reply starts with whitespace ({content[:20]!r}); strip it")
    return [tok.im_start_id, *body, tok.im_end_id], 1 + len(head)


def encode_chat(tok, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of a conversation (BOS first, each message as a ChatML block and "\\n"), and the loss
    spans: [(a, b)] meaning targets a..b-1 count (target j predicts ids[j + 1]): each assistant turn's
    text and its `<|im_end|>`. With add_generation_prompt, the ids end with `<|im_start|>assistant\\n`."""
    ids, spans = [tok.bos_id], []
    newline = tok.encode("\n")
    for m in messages:
        block, start = _block(tok, m["role"], m["content"])
        if m["role"] == "assistant":
            # targets from the last token before the text up to the one predicting <|im_end|>
            spans.append((len(ids) + start - 1, len(ids) + len(block) - 1))
        ids += block + newline
    if add_generation_prompt:
        ids += [tok.im_start_id, *tok.encode("assistant\n")]
    return ids, spans


def encode_dialog(tok, user: str, assistant: str, system: str | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """encode_chat of one exchange (with an optional system prompt)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return encode_chat(tok, messages)


def encode_prompt(tok, messages: list[dict] | str) -> list[int]:
    """Token ids that ask the model for the assistant's next reply: a conversation ending on a user turn,
    or one user message as a string."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return encode_chat(tok, messages, add_generation_prompt=True)[0]


def parse_dialog_line(d, where: str) -> dict:
    """One JSONL training line as {"messages": [...], "source": where}: either
    {"messages": [{"role", "content"}, ...]} (OpenAI fine-tuning / Hugging Face chat datasets) or the
    older {"user": ..., "assistant": ...}. Errors start with `where` (file:line)."""
    if not isinstance(d, dict):
        raise ClgptError(f'{where}: expected an object {{"messages": [...]}} or {{"user": ..., "assistant": ...}}')
    if "messages" in d:
        extra = sorted(set(d) - {"messages"})
        if extra:
            raise ClgptError(f'{where}: unknown field {extra[0]!r} beside "messages"')
        return {"messages": check_messages(d["messages"], where), "source": where}
    for key in ("user", "assistant"):
        if key in d and d[key] is not None and not isinstance(d[key], str):
            example = f': "{key}": "{d[key]}"' if isinstance(d[key], (int, float)) and not isinstance(d[key], bool) else ""
            raise ClgptError(f'{where}: "{key}" is {_kind(d[key])} ({_json(d[key])}), not text; write it as a string '
                             f'in quotes{example}')
        if not isinstance(d.get(key), str) or not d[key].strip():
            raise ClgptError(f'{where}: missing or empty "{key}" field; each line needs "user" and "assistant" strings '
                             'or a "messages" list')
    extra = set(d) - {"user", "assistant"}
    if extra:
        raise ClgptError(f"{where}: unknown field {sorted(extra)[0]!r}; only \"user\" and \"assistant\" are allowed")
    messages = [{"role": "user", "content": d["user"]}, {"role": "assistant", "content": d["assistant"]}]
    return {"messages": messages, "source": where}


def turns(messages: list[dict]) -> list[tuple[list[dict], str]]:
    """(the conversation before it, the reply) for each assistant turn."""
    return [(messages[:i], m["content"]) for i, m in enumerate(messages) if m["role"] == "assistant"]


PROBE_KINDS = ("system", "turn2", "turn3")


def chat_probes(pairs: list[tuple[str, str]], systems: list[str]) -> list[tuple[str, list[dict], list[str], str]]:
    """Conversations that ask each (question, answer) pair of `pairs` three ways, for checking a model in
    a real chat: after a system prompt (kind "system", systems taken in turn), and as the 2nd ("turn2") and
    3rd ("turn3") user turn of a conversation whose earlier turns ask the next pairs of the list.
    -> [(kind, opening messages (the system prompt or nothing), user questions in order, expected last reply)];
    the earlier replies are whatever the model answers."""
    n = len(pairs)
    out = []
    for i, (question, answer) in enumerate(pairs):
        if systems:
            out.append(("system", [{"role": "system", "content": systems[i % len(systems)]}], [question], answer))
        if n > 2:
            out.append(("turn2", [], [pairs[(i + 1) % n][0], question], answer))
            out.append(("turn3", [], [pairs[(i + 1) % n][0], pairs[(i + 2) % n][0], question], answer))
    return out


# A held-out system prompt of at least this many words counts as a paragraph (the defaults clients ship
# are 30 to 70 words); shorter ones as one line.
PARAGRAPH_WORDS = 25


def heldout_systems(tune_dialogs: list[dict], heldout_dialogs: list[dict]) -> list[str]:
    """The system prompts that held-out dialogs use and no tune dialog does, in order of first use."""
    trained = {d["messages"][0]["content"] for d in tune_dialogs if d["messages"][0]["role"] == "system"}
    out = []
    for d in heldout_dialogs:
        first = d["messages"][0]
        if first["role"] == "system" and first["content"] not in trained and first["content"] not in out:
            out.append(first["content"])
    return out


def system_probes(pairs: list[tuple[str, str]], systems: list[str]) -> list[tuple[str, list[dict], list[str], str]]:
    """Conversations that ask each (question, answer) pair of `pairs` after a system prompt (systems taken
    in turn): as the first user turn (kind "first"), and as the 2nd or 3rd (kind "later", alternating)
    after the next pairs of the list. Same form as chat_probes'."""
    n, out = len(pairs), []
    for i, (question, answer) in enumerate(pairs):
        opening = [{"role": "system", "content": systems[i % len(systems)]}]
        out.append(("first", opening, [question], answer))
        if n > 2:
            before = [pairs[(i + k) % n][0] for k in range(1, 2 + i % 2)]
            out.append(("later", opening, [*before, question], answer))
    return out

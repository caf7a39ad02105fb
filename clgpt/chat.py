"""The chat format, in one place: the tune stage trains on it, `clgpt generate --chat` and the evaluation
prompt with it, and the GGUF carries it as a Jinja template (Ollama's Modelfile as a Go template).

A conversation is BOS, then turns: `<user>{text}` and `<assistant>{text}</s>`. The loss covers the
assistant's tokens and its `</s>`; a prompt ends with `<assistant>` so the model writes the reply.
BOS: the Jinja template starts with `{{ bos_token }}` because llama-cpp-python tokenizes a rendered
chat prompt without adding BOS; llama.cpp's own chat code strips a leading BOS from the rendered text and
adds it through `tokenizer.ggml.add_bos_token` (true). Ollama's Go template has no BOS: Ollama adds it
from the tokenizer. Every path therefore sees exactly one `<s>`, as `encode_*` below produce.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<assistant>{{ message['content'] }}</s>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

OLLAMA_TEMPLATE = (
    '{{- range .Messages }}{{- if eq .Role "user" }}<user>{{ .Content }}'
    '{{- else if eq .Role "assistant" }}<assistant>{{ .Content }}</s>{{- end }}{{- end }}<assistant>'
)


def encode_dialog(tok, user: str, assistant: str) -> tuple[list[int], int]:
    """Token ids of one training dialog, and the index of the `<assistant>` token.

    Targets are ids[1:]; target j counts in the loss when j >= that index (assistant text and `</s>`).
    """
    ids = [tok.bos_id, tok.user_id, *tok.encode(user), tok.assistant_id]
    start = len(ids) - 1
    ids += [*tok.encode(assistant), tok.eos_id]
    return ids, start


def encode_prompt(tok, user: str) -> list[int]:
    """Token ids that ask the model for the assistant's reply to one user message."""
    return [tok.bos_id, tok.user_id, *tok.encode(user), tok.assistant_id]

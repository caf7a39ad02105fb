"""Kept so that `from clgpt.engine_llama import make_engine, LlamaEngine` still works: the llama model
lives in clgpt/llama.py, make_engine in clgpt/engine.py."""

from clgpt.engine import make_engine  # noqa: F401
from clgpt.llama import LlamaEngine  # noqa: F401

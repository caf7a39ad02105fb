"""clgpt: train a small GPT-style language model on any OpenCL device and export it as GGUF."""

__version__ = "0.1.0"

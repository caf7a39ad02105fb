"""The inference layer: a trained model answering, on clgpt's own OpenCL forward pass.

    kvcache.py       decoding with a key/value cache: prefill with the engine's forward, then a token a step
    generate.py      sampling, streamed; llama.cpp's end-of-generation set of a GGUF
    interactive.py   text streamed as UTF-8 completes, and `clgpt chat`
"""

"""Text in and out of token ids: the byte-level BPE tokenizer and the chat format.

    bpe.py          the primitives (minbpe's base): get_stats, merge, encode_ids by merge rank
    tokenizer.py    byte-level BPE: train, encode, decode, save/load, vocab dump; the readable reference rules
    bpe_engine.py   the compiled engines held to those rules: rustbpe trains, tiktoken encodes
    chat.py         ChatML, shared by tune, generate, the evaluation prompts and the GGUF template
"""

"""What a model is saved as: checkpoints between stages, the GGUF it ships as, the Hugging Face folder.

    checkpoint.py   one .npz per checkpoint: shape, weights, AdamW and sampler state; written atomically
    gguf.py         GGUF export (f32/f16/q8_0/q4_0) and read-back
    hf_export.py    a Hugging Face folder: safetensors, configs, tokenizer.json
"""

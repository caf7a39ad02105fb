"""The models: each architecture's forward and backward, written against clgpt.ops, and what they share.

    base.py             EngineBase: token checks, the logits and loss head, the backward's head, dropout state
    gpt2.py, llama.py   GPT2Engine, LlamaEngine: one forward and one backward each
    factory.py          make_engine: the engine for cfg.arch (the only module that imports every engine)
    params.py           ParamStore: weights, gradients and AdamW state as flat device buffers
    lora.py             LoRA adapters' shapes, merge and adapter GGUF; lora_engine.py runs them on an engine
    dropout.py          counter-hash dropout masks (the kernels' and the references')
    reference*.py       float64 numpy references of every op and of the whole models (tests)

The model's shape (ModelConfig) sits one layer down, in clgpt/model.py: the launchers size kernels by it.
This file imports nothing, so reading one module here (a reference, the LoRA shapes) needs no OpenCL.
"""

"""Stage export: the final model (tuned, or pretrained when there is no tune stage) as GGUF (llama.cpp,
LM Studio, Ollama) and an Ollama Modelfile; after a LoRA tune (tune.lora) also the pretrained base and the
adapter, for llama.cpp's `-m lora/base.gguf --lora lora/adapter.gguf`."""

import hashlib
import json
import os

from clgpt.errors import ClgptError
from clgpt.io.checkpoint import load_checkpoint
from clgpt.io.gguf import export_gguf, write_modelfile
from clgpt.models.lora import checkpoint_lora, export_adapter
from clgpt.stage import run_script
from clgpt.text.tokenizer import Tokenizer


def provenance(ckpt: dict, metrics_path: str) -> dict:
    """What the GGUF records about how it was made: steps, final losses, corpus and config hashes."""
    with open(metrics_path, encoding="utf-8") as f:
        metrics = json.load(f)
    extra = ckpt["extra"]
    meta = {"tune_steps": ckpt["step"]} if extra.get("stage", "tune") == "tune" else {"pretrain_steps": ckpt["step"]}
    for key in ("pretrain_steps", "corpus_sha256", "settings_sha256", "pretrain_settings_sha256", "final_loss"):
        if key in extra:
            meta[key] = extra[key]
    for key in ("pretrain_heldout_loss", "tune_heldout_loss", "tune_exact_match"):
        if key in metrics:
            meta[key] = metrics[key]
    meta["config_sha256"] = hashlib.sha256(
        json.dumps({k: meta.get(k) for k in ("settings_sha256", "pretrain_settings_sha256")}, sort_keys=True).encode()
        + ckpt["cfg"].to_json().encode()
    ).hexdigest()
    return meta


def main(model: str, tokenizer: str, metrics: str, settings: dict, gguf: str, modelfile: str,
         pretrained: str | None = None, lora_base: str | None = None, lora_adapter: str | None = None) -> None:
    """gguf: the model (a LoRA tune's merged weights); with a LoRA tune also lora_base (the pretrained model the
    adapters were trained on) and lora_adapter (the adapter GGUF for llama.cpp's --lora)."""
    ckpt = load_checkpoint(model)
    tok = Tokenizer.load(tokenizer)
    export_gguf(gguf, ckpt["cfg"], ckpt["params"], tok, ftype=settings["type"], name=settings["name"],
                metadata=provenance(ckpt, metrics))
    write_modelfile(modelfile, os.path.basename(gguf), ckpt["cfg"])
    lora = checkpoint_lora(ckpt)
    if (lora is None) != (lora_adapter is None):
        raise ClgptError(f"{model}: {'a LoRA' if lora else 'not a LoRA'} tune, but the export stage was "
                         f"{'not ' if lora else ''}asked for the adapter; re-run the tune stage with this config")
    if lora is not None:
        spec, adapters = lora
        base = load_checkpoint(pretrained)
        export_gguf(lora_base, base["cfg"], base["params"], tok, ftype=settings["type"], name=settings["name"] + "-base",
                    metadata=provenance(base, metrics))
        export_adapter(lora_adapter, base["cfg"], spec, adapters, name=settings["name"] + "-lora")


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        model=snakemake.input.model,
        tokenizer=snakemake.input.tokenizer,
        metrics=snakemake.input.metrics,
        settings=dict(snakemake.params.settings),
        gguf=snakemake.output.gguf,
        modelfile=snakemake.output.modelfile,
        pretrained=snakemake.input.get("pretrained"),
        lora_base=snakemake.output.get("lora_base"),
        lora_adapter=snakemake.output.get("lora_adapter"),
    )

"""Stage export, extra target `hf`: the final model (tuned, or pretrained when there is no tune stage) as a
Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that transformers loads with AutoModelForCausalLM / AutoTokenizer."""

import os
import sys

from clgpt.io.checkpoint import load_checkpoint
from clgpt.io.hf_export import export_hf, hf_architecture
from clgpt.stage import run_script
from clgpt.text.tokenizer import Tokenizer


def main(model: str, tokenizer: str, out_dir: str) -> None:
    ckpt = load_checkpoint(model)
    tok = Tokenizer.load(tokenizer)
    extra = ckpt["extra"]
    meta = {k: extra[k] for k in ("corpus_sha256", "settings_sha256", "final_loss") if k in extra}
    export_hf(out_dir, ckpt["cfg"], ckpt["params"], tok,
              metadata={"config": ckpt["cfg"].to_json(), "tokenizer_hash": tok.hash(), "step": ckpt["step"], **meta})
    print(f"export: {out_dir}/ as {hf_architecture(ckpt['cfg'])}", file=sys.stderr)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        model=snakemake.input.model,
        tokenizer=snakemake.input.tokenizer,
        out_dir=os.path.dirname(snakemake.output.config),
    )

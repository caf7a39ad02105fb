"""Stage pretrain: train the model from scratch on windows of the encoded text."""

from clgpt.stage import run_script
from clgpt.tokenizer import Tokenizer
from clgpt.train import run_stage


def main(encoded: str, heldout: str, tokenizer: str, model: dict, settings: dict, device: str, checkpoint: str,
         log_csv: str) -> None:
    tok = Tokenizer.load(tokenizer)
    run_stage(
        "pretrain", encoded, settings, checkpoint, log_csv,
        model={**model, "vocab_size": tok.vocab_size}, device=device or None, tokenizer_hash=tok.hash(),
        heldout=heldout,
    )


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        encoded=snakemake.input.encoded,
        heldout=snakemake.input.heldout,
        tokenizer=snakemake.input.tokenizer,
        model=dict(snakemake.params.model),
        settings=dict(snakemake.params.settings),
        device=snakemake.params.device,
        checkpoint=snakemake.output.checkpoint,
        log_csv=snakemake.output.log_csv,
    )

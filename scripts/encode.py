"""Stage encode: the corpus as token ids (uint16/uint32) with JSON sidecars."""

import sys

from clgpt.data import encode_dialog_files, encode_text_files
from clgpt.stage import run_script
from clgpt.tokenizer import Tokenizer


def main(tokenizer: str, pretrain: list, tune: list, pretrain_heldout: str, tune_heldout: str,
         n_ctx: int, out: dict) -> None:
    tok = Tokenizer.load(tokenizer)
    parts = {
        "pretrain": encode_text_files(tok, pretrain, out["pretrain"]),
        "pretrain_heldout": encode_text_files(tok, [pretrain_heldout], out["pretrain_heldout"]),
        "tune": encode_dialog_files(tok, tune, out["tune"], n_ctx),
        "tune_heldout": encode_dialog_files(tok, [tune_heldout], out["tune_heldout"], n_ctx),
    }
    for name, meta in parts.items():
        print(f"{name}: {meta['n_documents']} documents, {meta['n_tokens']} tokens", file=sys.stderr)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        tokenizer=snakemake.input.tokenizer,
        pretrain=list(snakemake.input.pretrain),
        tune=list(snakemake.input.tune),
        pretrain_heldout=snakemake.input.pretrain_heldout,
        tune_heldout=snakemake.input.tune_heldout,
        n_ctx=snakemake.params.n_ctx,
        out={k: snakemake.output[k] for k in ("pretrain", "pretrain_heldout", "tune", "tune_heldout")},
    )

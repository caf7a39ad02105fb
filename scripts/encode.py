"""Stage encode: the corpus as token ids (uint16/uint32), a binary document index and JSON sidecars.

Without corpus.pretrain_heldout (or corpus.tune_heldout) the held-out part is the last
corpus.val_fraction of the token stream (of the dialogs)."""

import sys

from clgpt.data import (
    default_workers,
    encode_dialogs,
    encode_text_files,
    files_sha256,
    read_dialogs_split,
)
from clgpt.stage import run_script
from clgpt.text.tokenizer import Tokenizer


def main(tokenizer: str, pretrain: list, tune: list, corpus: dict, n_ctx: int, out: dict) -> None:
    tok = Tokenizer.load(tokenizer)
    text = {"document": corpus["document"], "separator": corpus.get("separator"), "tokenizer_path": tokenizer,
            "workers": default_workers(pretrain), "where": corpus["pretrain"]}
    parts = {}
    if corpus.get("pretrain_heldout"):
        parts["pretrain"] = encode_text_files(tok, pretrain, out["pretrain"], **text)
        parts["pretrain_heldout"] = encode_text_files(
            tok, [corpus["pretrain_heldout"]], out["pretrain_heldout"],
            **{**text, "separator": None, "workers": 1, "where": corpus["pretrain_heldout"]},
        )
    else:
        parts["pretrain"] = encode_text_files(tok, pretrain, out["pretrain"], heldout_bin=out["pretrain_heldout"],
                                              val_fraction=corpus["val_fraction"], **text)
        parts["pretrain_heldout"] = {"n_documents": "-", "n_tokens": parts["pretrain"]["split"]["of_tokens"]
                                     - parts["pretrain"]["n_tokens"]}
    if tune:
        dialogs, heldout = read_dialogs_split(tune, corpus.get("tune_heldout"), corpus["val_fraction"])
        sha = files_sha256(tune + ([corpus["tune_heldout"]] if corpus.get("tune_heldout") else []))
        parts["tune"] = encode_dialogs(tok, dialogs, out["tune"], n_ctx, sha)
        parts["tune_heldout"] = encode_dialogs(tok, heldout, out["tune_heldout"], n_ctx, sha)
    for name, meta in parts.items():
        print(f"{name}: {meta['n_documents']} documents, {meta['n_tokens']} tokens", file=sys.stderr)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        tokenizer=snakemake.input.tokenizer,
        pretrain=list(snakemake.input.pretrain),
        tune=list(snakemake.input.tune),
        corpus=dict(snakemake.params.corpus),
        n_ctx=snakemake.params.n_ctx,
        out={k: snakemake.output[k] for k in ("pretrain", "pretrain_heldout", "tune", "tune_heldout")
             if k in snakemake.output.keys()},
    )

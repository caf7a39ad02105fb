"""Stage train_tokenizer: byte-level BPE on the pretrain text and the tune dialogs."""

from clgpt.data import dialog_texts, read_dialogs, read_text
from clgpt.stage import run_script
from clgpt.tokenizer import Tokenizer


def main(pretrain: list, tune: list, vocab_size: int, tokenizer_out: str, vocab_out: str) -> None:
    texts = [*read_text(pretrain), *dialog_texts(read_dialogs(tune))]
    tok = Tokenizer.train(texts, vocab_size)
    tok.save(tokenizer_out)
    tok.dump_vocab(vocab_out)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        pretrain=list(snakemake.input.pretrain),
        tune=list(snakemake.input.tune),
        vocab_size=snakemake.params.settings["vocab_size"],
        tokenizer_out=snakemake.output.tokenizer,
        vocab_out=snakemake.output.vocab,
    )

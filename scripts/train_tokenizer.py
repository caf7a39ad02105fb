"""Stage train_tokenizer: byte-level BPE on the pretrain text and the tune dialogs."""

from clgpt.data import dialog_texts, read_dialogs, text_segments
from clgpt.errors import ClgptError
from clgpt.stage import run_script
from clgpt.text.tokenizer import SPECIAL_TOKENS, TRAIN_BUFFER_MB, Tokenizer


def main(pretrain: list, tune: list, vocab_size: int, document: str, separator, tokenizer_out: str,
         vocab_out: str, buffer_mb: int = TRAIN_BUFFER_MB) -> None:
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        tok = Tokenizer([])  # byte level: no merges to learn, nothing to read
    else:
        dialogs = read_dialogs(tune) if tune else []

        def all_texts():  # a function: the reference trainer may need to read the text again
            yield from (seg for seg, _ in text_segments(pretrain, document, separator))
            yield from dialog_texts(dialogs)  # the chat format's text pieces, as encoded

        tok = Tokenizer.train(all_texts, vocab_size, buffer_mb=buffer_mb, progress=True)
        if tok.vocab_size < vocab_size:  # the corpus ran out of pairs to merge
            raise ClgptError(
                f"tokenizer.vocab_size={vocab_size} cannot be reached: the corpus has pairs for only {tok.vocab_size} "
                f"tokens; set tokenizer.vocab_size to {tok.vocab_size} or less in config.yaml, or add text"
            )
    tok.save(tokenizer_out)
    tok.dump_vocab(vocab_out)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        pretrain=list(snakemake.input.pretrain),
        tune=list(snakemake.input.tune),
        vocab_size=snakemake.params.settings["vocab_size"],
        buffer_mb=snakemake.params.settings.get("train_buffer_mb", TRAIN_BUFFER_MB),
        document=snakemake.params.corpus["document"],
        separator=snakemake.params.corpus.get("separator"),
        tokenizer_out=snakemake.output.tokenizer,
        vocab_out=snakemake.output.vocab,
    )

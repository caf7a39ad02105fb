"""Stage train_tokenizer: byte-level BPE on the pretrain text and the tune dialogs."""

from clgpt.data import corpus_files, read_dialogs, read_text
from clgpt.stage import run_script
from clgpt.tokenizer import Tokenizer


def main(pretrain_dir: str, tune_dir: str, vocab_size: int, tokenizer_out: str, vocab_out: str) -> None:
    dialogs = read_dialogs(corpus_files(tune_dir, ".jsonl"))
    texts = [*read_text(corpus_files(pretrain_dir, ".txt"))]
    texts += [t for d in dialogs for t in (d["user"], d["assistant"])]
    tok = Tokenizer.train(texts, vocab_size)
    tok.save(tokenizer_out)
    tok.dump_vocab(vocab_out)


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        pretrain_dir=snakemake.params.pretrain_dir,
        tune_dir=snakemake.params.tune_dir,
        vocab_size=snakemake.params.settings["vocab_size"],
        tokenizer_out=snakemake.output.tokenizer,
        vocab_out=snakemake.output.vocab,
    )

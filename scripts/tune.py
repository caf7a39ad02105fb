"""Stage tune: continue from the pretrained checkpoint on User/Assistant dialogs (loss on replies only)."""

from clgpt.stage import run_script
from clgpt.train import run_stage


def main(pretrained: str, encoded: str, heldout: str, mix: str, settings: dict, device: str, checkpoint: str,
         log_csv: str) -> None:
    run_stage(
        "tune", encoded, settings, checkpoint, log_csv,
        init_ckpt=pretrained, mix_encoded=mix, heldout=heldout, device=device or None,
    )


if __name__ == "__main__" and "snakemake" in globals():
    run_script(
        main,
        snakemake.log[0],
        pretrained=snakemake.input.pretrained,
        encoded=snakemake.input.encoded,
        heldout=snakemake.input.heldout,
        mix=snakemake.input.mix,
        settings=dict(snakemake.params.settings),
        device=snakemake.params.device,
        checkpoint=snakemake.output.checkpoint,
        log_csv=snakemake.output.log_csv,
    )

"""clgpt's pretrain stage on the character CPU recipe (configs/shakespeare_char_cpu.yaml) with one seed, then its
held-out loss over the whole held-out split in consecutive windows, in nats per byte (as the evaluate stage
scores it; nanoGPT's side: bench/nanogpt_heldout.py). Used by `bash bench/gpu.sh char-vocab`.
Run from the repository root:  python bench/clgpt_char_seed.py SEED [RESULTS_DIR [KEEP]]
RESULTS_DIR holds encoded/ and tokenizer/ of that config (default results); KEEP: best (default) or last."""
import runpy
import sys

from clgpt.config import load_workflow_config
from clgpt.data import load_encoded, text_batches
from clgpt.device.opencl import get_device
from clgpt.eval.evaluate import mean_loss, text_bytes, token_byte_lengths
from clgpt.io.checkpoint import load_checkpoint
from clgpt.models.factory import make_engine
from clgpt.text.tokenizer import Tokenizer
from clgpt.device.knobs import read as read_knobs  # noqa: E402

seed = int(sys.argv[1])
res = sys.argv[2] if len(sys.argv) > 2 else "results"
keep = sys.argv[3] if len(sys.argv) > 3 else "best"
cfg = load_workflow_config("config.yaml", configfiles=["configs/shakespeare_char_cpu.yaml"])
settings = dict(cfg["pretrain"], seed=seed, keep=keep)
ckpt = f"/tmp/clgpt_{seed}/model.ckpt"
runpy.run_path("scripts/pretrain.py")["main"](
    encoded=f"{res}/encoded/pretrain.bin", heldout=f"{res}/encoded/pretrain_heldout.bin",
    tokenizer=f"{res}/tokenizer/tokenizer.json", model=cfg["model"], settings=settings, device=cfg["device"],
    checkpoint=ckpt, log_csv=f"/tmp/clgpt_{seed}/log.csv")
ck = load_checkpoint(ckpt)
ids, _ = load_encoded(f"{res}/encoded/pretrain_heldout.bin")
tok = Tokenizer.load(f"{res}/tokenizer/tokenizer.json")
T, B = settings["seq_len"], 16
eng = make_engine(ck["cfg"], ck["params"], batch_size=B, seq_len=T, device=get_device(None), knobs=read_knobs())
loss, n = mean_loss(eng, text_batches(ids, T, B))
nbytes = text_bytes(ids, token_byte_lengths(tok))
print(f"clgpt seed={seed} bias={ck['cfg'].bias} vocab={ck['cfg'].vocab_size} heldout {loss:.4f} nats/token "
      f"over {n} tokens, {loss * n / nbytes:.4f} nats/byte (step {ck['step']})")

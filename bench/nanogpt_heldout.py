"""Held-out loss of a nanoGPT ckpt.pt on its whole val.bin, as clgpt's evaluate stage computes it: consecutive
windows of block_size tokens (every token predicted once, a shorter last window), token-weighted mean; also nats
per byte (the text is ASCII here: one char = one byte, checked). Windows go 64 at a time, on CUDA when present.
Run in nanoGPT's folder (it imports nanoGPT's model.py):  python nanogpt_heldout.py OUT_DIR DATA_DIR"""
import os, pickle, sys
import numpy as np, torch
sys.path.insert(0, os.getcwd())  # nanoGPT's model.py
from model import GPT, GPTConfig
out_dir, data_dir = sys.argv[1], sys.argv[2]
device = "cuda" if torch.cuda.is_available() else "cpu"
ck = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu")
model = GPT(GPTConfig(**ck["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
model.eval().to(device)
meta = pickle.load(open(os.path.join(data_dir, "meta.pkl"), "rb"))
val = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).astype(np.int64)
nbytes = sum(len(meta["itos"][int(i)].encode()) for i in val[1:])
T = ck["model_args"]["block_size"]
starts = list(range(0, len(val) - 1, T))
total, n = 0.0, 0
with torch.no_grad():
    for full in (True, False):  # the whole windows in batches of 64, then the shorter last one alone
        rows = [s for s in starts if (s + T + 1 <= len(val)) == full]
        for i in range(0, len(rows), 64):
            w = np.stack([val[s:s + (T if full else len(val) - 1 - s) + 1] for s in rows[i:i + 64]])
            x, y = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (w[:, :-1], w[:, 1:]))
            _, loss = model(x, y)
            total += loss.item() * y.numel(); n += y.numel()
print(f"nanogpt: iter {ck['iter_num']} best_val_loss(estimate) {float(ck['best_val_loss']):.4f} "
      f"heldout {total / n:.4f} nats/token over {n} tokens, {total / nbytes:.4f} nats/byte")

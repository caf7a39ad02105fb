"""`python -m clgpt` / `clgpt`: devices, tokenize, generate, chat, train-tokenizer, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys

from clgpt.errors import ClgptError
from clgpt.device.knobs import read as read_knobs


def _load_tokenizer(path: str):
    """The tokenizer of a GGUF file or of a tokenizer JSON file."""
    if path.endswith(".gguf"):
        from clgpt.io.gguf import read_gguf

        return read_gguf(path)[2]
    from clgpt.text.tokenizer import Tokenizer

    return Tokenizer.load(path)


def cmd_devices(args) -> None:
    from clgpt.device.opencl import get_device, list_devices

    devices = list_devices()
    for index, name, kind, chosen, note in devices:
        print(f"{'*' if chosen else ' '} {index}  {kind:<4} {name}" + (f"  ({note})" if note else ""))
    print("(* = the device clgpt uses; choose another with `device:` in config.yaml, --device or PYOPENCL_CTX)")
    if not any(chosen for _, _, _, chosen, _ in devices):
        try:
            get_device(None)
        except ClgptError as e:
            ctx = os.environ.get("PYOPENCL_CTX", "")
            why = f"PYOPENCL_CTX={ctx!r} matches none of them" if ctx.strip() else str(e)
            raise ClgptError(f"{why}; clgpt would stop on it: unset PYOPENCL_CTX or set it to an index listed above") from None


def cmd_tokenize(args) -> None:
    print(json.dumps(_load_tokenizer(args.model).encode(args.text)))


def cmd_train_tokenizer(args) -> None:
    from clgpt.data import dialog_texts, read_dialogs, read_text
    from clgpt.text.tokenizer import Tokenizer

    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ClgptError(f"--out {args.out}: folder {os.path.dirname(args.out) or '.'} does not exist; create it first")
    if os.path.isdir(args.out):
        raise ClgptError(f"--out {args.out}: this is a folder; give the tokenizer file's name "
                         f"(e.g. --out {os.path.join(args.out, 'tokenizer.json')})")
    texts = []
    for path in args.files:
        if os.path.isdir(path):
            raise ClgptError(f"{path}: is a folder; give the text (.txt) or dialog (.jsonl) files in it")
        if path.endswith(".jsonl"):
            texts += list(dialog_texts(read_dialogs([path])))
        else:
            texts += list(read_text([path]))
    if not any(t.strip() for t in texts):
        raise ClgptError(f"{', '.join(args.files)}: no text to train on (empty or blank); give files with text")
    tok = Tokenizer.train(texts, args.vocab_size)
    if tok.vocab_size < args.vocab_size:
        raise ClgptError(
            f"--vocab-size {args.vocab_size} cannot be reached: this text has pairs for only {tok.vocab_size} "
            f"tokens; use --vocab-size {tok.vocab_size} or less, or more text"
        )
    tok.save(args.out)
    print(f"wrote {args.out}: {tok.vocab_size} tokens, {len(tok.merges)} merges", file=sys.stderr)


class _Turn(argparse.Action):
    """--system/--user/--assistant TEXT, kept in the order given (one list for all three)."""

    def __call__(self, parser, namespace, value, option_string=None):
        turns = list(getattr(namespace, "turns", None) or [])
        turns.append({"role": self.dest, "content": value})
        namespace.turns = turns


def chat_messages(chat: str | None, turns: list[dict]) -> list[dict]:
    """The conversation `clgpt generate` answers: --system/--user/--assistant turns in order, then --chat,
    which is a JSON messages file (a list, or {"messages": [...]}) when it names an existing *.json file and
    otherwise one more user message. Checked by clgpt.text.chat.check_messages: it ends on a user turn."""
    import os

    from clgpt.text.chat import check_messages

    where = "generate"
    messages = list(turns)
    if chat is not None and chat.endswith(".json") and os.path.isfile(chat):
        where = chat
        try:
            with open(chat, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ClgptError(f"{chat}: cannot read the messages file ({e})") from None
        messages += data.get("messages") if isinstance(data, dict) else data
    elif chat is not None and chat.endswith(".json"):  # a messages file that is not there: never sent as text
        raise ClgptError(f"--chat {chat}: no such file; check the path of the messages file (a message that ends "
                         "in .json can be sent with --user)")
    elif chat is not None:
        messages.append({"role": "user", "content": chat})
    return check_messages(messages, where, prompt=True)


def cmd_generate(args) -> None:
    from clgpt.inference.generate import Generator, eog_ids
    from clgpt.io.gguf import read_gguf
    from clgpt.text.chat import encode_prompt

    turns = getattr(args, "turns", None) or []
    if (args.prompt is None) == (args.chat is None and not turns):
        raise ClgptError("generate: give either --prompt TEXT, or a conversation: --chat TEXT|FILE.json and/or "
                         "--system/--user/--assistant TEXT")
    messages = chat_messages(args.chat, turns) if args.prompt is None else None
    from clgpt.device.opencl import decode_device

    cfg, params, tok, kv = read_gguf(args.model)
    prompt_ids = encode_prompt(tok, messages) if messages is not None else [tok.bos_id, *tok.encode(args.prompt)]
    if len(prompt_ids) >= cfg.n_ctx:
        raise ClgptError(
            f"the prompt is {len(prompt_ids)} tokens and the model's context is {cfg.n_ctx}, which leaves no room "
            "for a reply; shorten the prompt"
        )
    from clgpt.inference.interactive import sampling_settings, stream_text

    gen = Generator(cfg, params, device=decode_device(args.device), knobs=read_knobs())  # once, at the edge
    out = gen.stream(prompt_ids, **sampling_settings(args, eog_ids(kv)))
    if args.show_probs:
        for i, p in out:
            print(f"{p:7.4f}  {i:6d}  {tok.decode([i])!r}", flush=True)
    else:
        stream_text(tok, (i for i, _ in out), sys.stdout)
        print(flush=True)


def cmd_chat(args) -> None:
    from clgpt.inference.interactive import run_chat

    run_chat(args, knobs=read_knobs())  # once, at the edge


def cmd_bench(args) -> None:
    from clgpt.bench import run_bench

    run_bench(args)


def cmd_tune_device(args) -> None:
    from clgpt.bench import run_tune_device

    run_tune_device(args)


def _shape_options(p) -> None:
    """The model and batch of `clgpt bench` and `clgpt tune-device`."""
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--ctx", type=int, default=80)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0 = --heads)")


def _sampling_options(p, max_tokens: int) -> None:
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="never stop at an end-of-generation token (EOS, EOT, ...): they are never drawn, as llama.cpp's flag")
    p.add_argument("--device", default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="clgpt", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list OpenCL devices and the one clgpt chooses")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("tokenize", help="print the token ids of TEXT as a JSON list")
    p.add_argument("model", help="a GGUF file or a tokenizer JSON file")
    p.add_argument("text")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer")
    p.add_argument("files", nargs="+", help="text files (one document per line) or .jsonl dialogs")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_train_tokenizer)

    p = sub.add_parser("generate", help="continue a prompt or answer a chat message with a GGUF model")
    p.add_argument("model", help="a GGUF file written by clgpt")
    p.add_argument("--prompt", help="plain text to continue")
    p.add_argument("--chat", metavar="TEXT|FILE.json",
                   help="a user message, or a JSON file of messages ([{\"role\", \"content\"}, ...]); the chat format is applied")
    for role in ("system", "user", "assistant"):
        p.add_argument(f"--{role}", dest=role, action=_Turn, metavar="TEXT",
                       help=f"{'an' if role[0] == 'a' else 'a'} {role} message of the conversation (repeatable; kept in the order given)")
    _sampling_options(p, max_tokens=64)
    p.add_argument("--show-probs", action="store_true", help="print each token with its probability")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="snakemake with config overrides as KEY=VALUE (pretrain.steps=100 --cores 1 model.gguf)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="KEY=VALUE overrides and snakemake's own arguments")

    p = sub.add_parser("chat", help="talk with a GGUF model in the terminal (/reset, /exit)")
    p.add_argument("model", help="a GGUF file written by clgpt")
    p.add_argument("--system", help="a system prompt that opens the conversation (kept across /reset)")
    _sampling_options(p, max_tokens=256)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="training tokens/s on random tokens, and GEMM GFLOP/s beside numpy")
    _shape_options(p)
    p.add_argument("--experts", type=int, default=0, help="llama: experts per feed-forward (0 = dense)")
    p.add_argument("--experts-used", type=int, default=0, help="llama: experts each token routes to")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gemm", type=int, default=1024, help="square GEMM size (0 = skip)")
    p.add_argument("--precision", default="auto", choices=["fp32", "tf32", "bf16", "auto"],
                   help="matmul operands (clgpt/device/precision.py)")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "batched"],
                   help="attention as flash attention's fused kernels (NVIDIA's bf16 or the portable fp32 ones) or "
                        "batched products, as a stage's")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability, as a training stage's")
    p.add_argument("--tuning", default="auto", metavar="auto|off|FILE",
                   help="the portable GEMM's and flash attention's tiles, as a stage's `tuning` setting (auto: tuned "
                        "on a GPU's first run)")
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune-device", help="measure the portable GEMM's and flash attention's tiles on a device for a "
                                           "model and batch")
    _shape_options(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=float, default=45.0, help="seconds after which no more candidates are started")
    p.add_argument("--max-candidates", type=int, default=0,
                   help="only the first N candidate tiles (0: all; quick checks)")
    p.add_argument("--out", help="also write the tuning file here (a stage's `tuning: FILE` pins it)")
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_tune_device)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):  # snakemake's options are not ours to parse
        from clgpt.runner import run

        try:
            return run(argv[1:])
        except ClgptError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ClgptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a read-only or missing output folder, a full disk
        from clgpt.stage import os_error_line

        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""dspec command line.

    python -m dspec generate [--model NAME|DIR] [--method METHOD] [--prompt TEXT | --batch-file F]
                             [--max-new-tokens N] [--temperature T] [--seed S]
                             [--block-size B] [--tokens-per-step K] [--threshold P] [--draft-len L]
                             [--option KEY=VALUE ...] [--drafter NAME|DIR] [--json]
    python -m dspec bench    [--dllm NAME|DIR] [--target NAME|DIR] [--configs a,b] [--quick] ...

``generate`` decodes one prompt (or a batch read from a file) and prints the text, then the
stats as one JSON line on stderr.  ``bench`` runs the end-to-end method x prompt-set grid
(``dspec.bench_e2e``) and writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspec._cli import add_threads_argument, dumps, error_line, json_safe, parse_value, run_command

# the method options with a flag of their own (DESIGN.md's common names)
OPTION_FLAGS = (
    ("block_size", int, "block length of block diffusion"),
    ("tokens_per_step", int, "static diffusion schedule: tokens unmasked per step"),
    ("threshold", float, "dynamic diffusion schedule: confidence threshold in (0, 1]"),
    ("draft_len", int, "speculative methods: tokens drafted per round"),
)


def parse_options(pairs, parser: argparse.ArgumentParser | None = None) -> dict:
    """``["key=value", ...]`` -> ``{"key": parsed value}`` (dashes in keys become underscores)."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            msg = f"--option expects KEY=VALUE with KEY a name, got {pair!r}"
            if parser is None:
                raise ValueError(msg)
            parser.error(msg)
        if key in out:
            msg = f"--option {key} given twice"
            if parser is None:
                raise ValueError(msg)
            parser.error(msg)
        out[key] = parse_value(value)
    return out


def read_batch_file(path: str) -> list[str]:
    """Prompts of a batch file: JSON lines (a string, or an object with "prompt") when the
    name ends in .jsonl, else one prompt per non-empty line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
                if isinstance(item, dict):
                    item = item.get("prompt")
                if not isinstance(item, str):
                    raise ValueError(f"{path}:{n}: expected a JSON string or an object with a string 'prompt'")
                prompts.append(item)
            else:
                prompts.append(line.rstrip("\n"))
    if not prompts:
        raise ValueError(f"--batch-file {path} holds no prompt")
    return prompts


def _generate(args, parser) -> int:
    import dspec
    from dspec.decode.generate import method_module
    from dspec.models.embedded import chat_prompt, is_chat_model

    options = parse_options(args.option, parser)
    for name, _, _ in OPTION_FLAGS:
        value = getattr(args, name)
        if value is not None:
            if name in options:
                parser.error(f"--{name.replace('_', '-')} and --option {name}=... both given")
            options[name] = value
    if args.batch_file is not None:
        try:
            prompts = read_batch_file(args.batch_file)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    else:
        prompts = [args.prompt]
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    try:
        model = dspec.load(args.model, device=args.device, dtype=args.dtype)
        drafter = None
        if args.drafter:
            kind = getattr(method_module(args.method), "DRAFTER", False)
            if not kind:
                raise ValueError(f"--drafter: method {args.method!r} takes no drafter")
            # a dLLM drafter is a model; DFlash / VP drafters are resolved by the method
            # itself (a shipped drafter name, a directory, or "DFLASH_DIR,VP_DIR" for d2sd)
            drafter = (
                dspec.load(args.drafter, device=args.device, dtype=args.dtype) if kind == "model" else args.drafter
            )
        chat = is_chat_model(model) if args.chat is None else args.chat
        if chat and not is_chat_model(model):
            parser.error(f"--chat: {args.model} has no chat template (ChatML tokens)")
        texts = [chat_prompt(p) if chat else p for p in prompts]
        kw = dict(
            method=args.method,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            progress=not args.no_progress,
            preset=args.preset,
            **options,
        )
        if drafter is not None:
            kw["drafter"] = drafter
        outs = dspec.generate(model, texts if args.batch_file is not None else texts[0], **kw)
    except ValueError as e:
        msg = error_line(e)
        if args.drafter and "drafter" in msg:
            msg = msg.replace("drafter=", "--drafter ")
        print(f"\nerror: {msg}", file=sys.stderr)
        return 2
    outs = outs if isinstance(outs, list) else [outs]
    if args.json:
        for p, out in zip(prompts, outs):
            print(dumps({"prompt": p, "text": out.text, "tokens": out.tokens, "stats": json_safe(out.stats)}))
        return 0
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"### [{i}] {prompts[i][:60]!r}")
        print(out.text)
    stats = {k: v for k, v in outs[0].stats.items() if k != "new_tokens"}
    stats["new_tokens"] = [len(o.tokens) for o in outs] if len(outs) > 1 else len(outs[0].tokens)
    print(dumps(json_safe(stats)), file=sys.stderr)
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; a flag's default shown unless its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _method_options_text() -> str:
    from dspec.decode.generate import available_methods, method_module

    lines = ["method options (--option KEY=VALUE, or the flags above):"]
    for name in available_methods():
        module = method_module(name)
        opts = ", ".join(module.OPTIONS) or "none"
        drafter = {"model": "; --drafter MODEL", "block": "; --drafter NAME|DIR"}.get(module.DRAFTER, "")
        lines.append(f"  {name:10s} {opts}{drafter}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from dspec.bench_e2e import add_arguments as add_bench_arguments  # the bench command's own flags
    from dspec.decode.generate import available_methods
    from dspec.hub import DEFAULT_MODEL, available_models

    parser = argparse.ArgumentParser(
        prog="python -m dspec",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="decode a prompt and print the text and the stats",
        description="Decode a prompt (or a batch) with a shipped model or a checkpoint "
        "directory; print the text, then the stats as one JSON line on stderr.",
        epilog="examples:\n"
        "  python -m dspec generate --prompt 'What is the capital of France?'\n"
        "  python -m dspec generate --model tiny-bd --method diffusion --threshold 0.9 "
        "--no-chat --prompt 'Compute: 3 + 4 ='\n"
        "  python -m dspec generate --model CKPT_DIR --method ssd --option draft_len=4\n\n" + _method_options_text(),
        formatter_class=_HelpFormatter,
    )
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"shipped model name ({', '.join(available_models())}) or a checkpoint directory",
    )
    g.add_argument(
        "--method",
        default="ar",
        choices=available_methods(),
        help="decoding method; ssd is Self Speculative Decoding for dLLMs (arXiv 2510.04147), "
        "not Speculative Speculative Decoding (arXiv 2603.03251)",
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="What is the capital of France?", help="the prompt text")
    src.add_argument(
        "--batch-file",
        default=None,
        metavar="FILE",
        help="decode these prompts as one batch: one per line, or JSON lines "
        "(a string or {\"prompt\": ...}) for a .jsonl file",
    )
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; <= 0: greedy")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (none: fresh OS entropy)")
    for name, kind, help_ in OPTION_FLAGS:
        g.add_argument(
            f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=f"{help_} (method option {name})"
        )
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other method option, repeatable; VALUE is parsed as bool "
        "(true/false), none, int, float, else a string",
    )
    g.add_argument(
        "--preset",
        choices=["paper"],
        default=None,
        help="paper: the method as its paper publishes it (no dspec-only trees, lookup branches or "
        "redraft blocks; every draft verified); explicit options still win",
    )
    g.add_argument(
        "--drafter",
        default=None,
        metavar="NAME|DIR",
        help="drafter model for methods that take one (default: the one dspec ships for the target)",
    )
    g.add_argument("--device", default="cpu", help="torch device of the model (cpu or cuda)")
    g.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weight dtype (default: bf16 on CPUs with native bf16 matmul, else float32; $DSPEC_DTYPE)",
    )
    add_threads_argument(g)
    chat = g.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the chat template (default: when the model has one)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    g.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (prompt, text, tokens, stats) instead"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(func=_generate, sub=g)

    b = sub.add_parser(
        "bench",
        help="end-to-end benchmark: methods x prompt sets (JSON + PNG)",
        description="End-to-end benchmark grid (dspec.bench_e2e): every "
        "configuration x prompt set; tokens/s, forwards, acceptance, "
        "accuracy; JSON + PNG.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(b)
    b.set_defaults(func=_bench, sub=b)
    return parser


def _bench(args, parser) -> int:
    from dspec.bench_e2e import run

    return run(args, parser)


def main(argv=None) -> int:
    """Run one command; returns its exit status.  Bad flags exit 2 through argparse; user
    errors of the command (a bad value, a missing model or file, an unusable path) print one
    ``error:`` line and return 2; Ctrl-C returns 130 (``dspec._cli.run_command``)."""
    return run_command(_main, argv)


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from dspec.cpu import apply_threads

    try:
        apply_threads(args.threads)
    except ValueError as e:
        args.sub.error(f"--threads: {e}")
    return args.func(args, args.sub)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m dspec generate ...``: decode text with a shipped model or a checkpoint."""
from __future__ import annotations

import argparse
import json
import sys


def _generate(args) -> int:
    import dspec
    from dspec.models.embedded import chat_prompt

    model = dspec.load(args.model, device=args.device)
    prompt = chat_prompt(args.prompt) if args.chat else args.prompt
    out = dspec.generate(model, prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed, progress=True)
    print(out.text)
    print(json.dumps({k: v for k, v in out.stats.items()}, indent=None), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode one prompt and print the text and the stats")
    g.add_argument("--model", default="smollm2-135m", help="shipped name or checkpoint directory")
    g.add_argument("--method", default="ar", help="decoding method (ar; more to come)")
    g.add_argument("--prompt", default="What is the capital of France?")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="<= 0: greedy")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cpu")
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompt as raw text instead of a chat turn")
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

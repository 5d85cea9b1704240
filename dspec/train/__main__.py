"""``python -m dspec.train RECIPE --out DIR [--minutes M] [--device cuda] [--resume]``."""

from __future__ import annotations

import argparse
import sys

from .._cli import dumps, error_line, run_command


def main(argv=None) -> int:
    from .recipes import RECIPES

    lines = "\n".join(f"  {name:10s} {r.description}" for name, r in RECIPES.items())
    parser = argparse.ArgumentParser(
        prog="python -m dspec.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a dspec recipe; writes a checkpoint directory dspec.load reads "
        "(<out>/model), a JSON log and a loss curve.",
        epilog=f"recipes:\n{lines}\n\nexamples:\n"
        "  python -m dspec.train tiny-ar --out runs/tiny-ar --minutes 18 --threads 1\n"
        "  python -m dspec.train tiny-bd --out runs/tiny-bd --resume --minutes 10\n"
        "  python -m dspec.train bd-adapt --init tiny-ar --out runs/tiny-ar-bd --minutes 10\n"
        "  python -m dspec.train bd-adapt --init smollm2-135m --mask-token '<filename>' "
        "--out runs/smollm2-bd --device cuda --minutes 60\n"
        "  python -m dspec.train bd-adapt --init smollm2-135m --mask-token '<filename>' "
        "--lora-rank 32 --out runs/smollm2-bd-lora --device cuda --minutes 9 --resume",
    )
    parser.add_argument("recipe", choices=sorted(RECIPES), help="recipe name")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-time budget of this call (default: the recipe's, unless --max-steps)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda)")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    parser.add_argument("--init", default=None, help="bd-adapt: source checkpoint directory or shipped name")
    parser.add_argument(
        "--mask-token", default=None, help="bd-adapt: token to use as [MASK] when the tokenizer has no <|MASK|>"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="bd-adapt: LoRA rank (0 = full fine-tune); R > 0 trains and saves only "
        "adapters + the [MASK] row to <out>/adapter",
    )
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default 2 R)")
    parser.add_argument(
        "--lora-targets", default=None, help="comma-separated projections (default q,k,v,o,gate,up,down _proj)"
    )
    parser.add_argument(
        "--block-sizes",
        default=None,
        help="block-diffusion block sizes drawn per step, comma-separated (uniform), "
        "e.g. 1,2,4,8,16,32 (default: the recipe's)",
    )
    parser.add_argument("--tokenizer", default=None, help="directory with a tokenizer.json to reuse")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--rows", type=int, default=None, help="packed training rows to prepare")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = parser.parse_args(argv)
    from .recipes import run_recipe

    overrides = {
        k: v
        for k, v in (("batch_size", args.batch_size), ("micro_batch_size", args.micro_batch_size), ("lr", args.lr))
        if v is not None
    }
    if args.block_sizes:
        try:
            sizes = tuple(int(b) for b in args.block_sizes.split(","))
        except ValueError:
            print(f"error: --block-sizes must be comma-separated ints, got {args.block_sizes!r}", file=sys.stderr)
            return 2
        overrides.update(block_sizes=sizes, block_weights=None)
    if "lr" in overrides:
        overrides["min_lr"] = overrides["lr"] / 10
    try:
        summary = run_recipe(
            args.recipe,
            args.out,
            minutes=args.minutes,
            max_steps=args.max_steps,
            device=args.device,
            resume=args.resume,
            init=args.init,
            tokenizer=args.tokenizer,
            mask_token=args.mask_token,
            num_rows=args.rows,
            threads=args.threads,
            progress=not args.no_progress,
            seed=args.seed,
            train_overrides=overrides,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_targets=tuple(args.lora_targets.split(",")) if args.lora_targets else None,
        )
    except ValueError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    print(dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))

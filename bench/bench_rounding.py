"""How often a batched verification forward and one-token decode steps pick a different
greedy token, per dtype: the measured side of "lossless is exact in fp32".

For each prompt: greedy `ar` decodes T tokens one forward per token (N = 1 steps); then the
same sequence is re-read by verification-shaped forwards of W tokens after the same prompt
prefill (teacher forcing, as `dflash` / `diffuspec` / `s2d2` verify a chain: the first
window starts with the first generated token).  A position
counts as a flip when the verification forward's argmax differs from the token the
one-token step chose.  Any flip can make a speculative method's output leave `ar`'s.

    python bench/bench_rounding.py [--model smollm2-135m] [--dtypes float32,bfloat16]
Writes bench/results/cpu/rounding.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, out_dir, write_json


@torch.no_grad()
def flips(model, prompt: list[int], tokens: int, window: int) -> tuple[int, int, float]:
    """(flipped positions, compared positions, max |logit difference|) for one prompt."""
    import dspec

    gen = dspec.generate(model, prompt, method="ar", max_new_tokens=tokens).tokens
    if len(gen) < 2:
        return 0, 0, 0.0
    # the one-token steps' logits, recomputed exactly as ar ran them
    cache = model.new_cache(1)
    out = model(model.plan([prompt], cache), logits="last")
    cache.append(out.suffix_kv)
    step_logits = [out.logits[0, -1]]
    for t in gen[:-1]:
        out = model(model.plan([[t]], cache), logits="last")
        cache.append(out.suffix_kv)
        step_logits.append(out.logits[0, -1])
    step_logits = torch.stack(step_logits).float()  # row i predicts gen[i]
    # verification forwards as the speculative methods run them: the same prompt prefill,
    # then windows of [last committed token] + W - 1 drafts, all W committed
    cache = model.new_cache(1)
    out = model(model.plan([prompt], cache), logits=None)
    cache.append(out.suffix_kv)
    seq = gen[:-1]
    ver = []
    for start in range(0, len(seq), window):
        chunk = seq[start : start + window]
        out = model(model.plan([chunk], cache), logits="all")
        cache.append(out.suffix_kv)
        ver.append(out.logits[0])
    ver = torch.cat(ver).float()  # row i predicts gen[i + 1]
    steps = step_logits[1:]
    flipped = int((ver.argmax(-1) != steps.argmax(-1)).sum())
    return flipped, len(seq), float((ver - steps).abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--threads", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import dspec
    from dspec.bench_e2e import is_chat_model
    from dspec.cpu import apply_threads
    from dspec.models.embedded import chat_prompt
    from dspec.tasks import PROMPT_SETS, prompt_set

    apply_threads(args.threads)
    env = environment("cpu")
    rows = []
    for dtype_name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        model = dspec.load(args.model, dtype=getattr(torch, dtype_name))
        for pset in PROMPT_SETS:
            texts = [problem.prompt for problem in prompt_set(pset, args.prompts)]
            if is_chat_model(model):
                texts = [chat_prompt(t) for t in texts]
            total = flipped = 0
            worst = 0.0
            for text in texts:
                f, n, diff = flips(model, model.tokenizer.encode(text), args.tokens, args.window)
                flipped, total, worst = flipped + f, total + n, max(worst, diff)
            row = {
                "dtype": dtype_name,
                "prompt_set": pset,
                "positions": total,
                "flips": flipped,
                "flip_rate": flipped / max(total, 1),
                "max_abs_logit_diff": worst,
                "window": args.window,
            }
            rows.append(row)
            print(
                f"{dtype_name:9s} {pset:10s} {flipped:4d} / {total:5d} positions flip "
                f"({row['flip_rate']:.2%}); max |logit diff| {worst:.3g}",
                flush=True,
            )
    payload = {"bench": "rounding", "model": args.model, "tokens": args.tokens, "env": env, "results": rows}
    path = out_dir(args, "cpu") / "rounding.json"
    write_json(path, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

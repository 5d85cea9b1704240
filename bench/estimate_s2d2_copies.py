"""What re-drafting at every rejection point could give S2D2, estimated from the model itself.

    python bench/estimate_s2d2_copies.py [--prompts 8] [--block-sizes 4,8]

S2D2 (greedy, policy ``always``) alternates a drafting forward and a verification forward:
a rejection discards the speculative block, so the next drafts cost a forward of their own.
The variant estimated here adds, to each verification forward, one [MASK] copy of the block
per possible rejection point j (slots < j the drafts, slots >= j [MASK]; the model's clean
rows attend causally, so the copy shares the chain's keys and adds only its [MASK] rows) and
the next block's all-[MASK] copy: whatever the verification decides, the next drafts are
already computed, and every forward verifies.

For each grid prompt, the reference (``ar`` on the target = ``smollm2-135m-bd`` at block
size 1) fixes the text; every block's states "first j slots right, the rest [MASK]" are
forwarded once and their argmax drafts tabulated; both schedules are then replayed greedily
on that table: tokens per forward of the current alternation and of the copies variant, and
the rows a copies forward carries.  An estimate: it counts forwards, not their cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import grid_texts
from dspec.decode.diffusion import prefill_prompt_blocks
from dspec.masks import block_diffusion
from dspec.models import AttentionPlan


@torch.no_grad()
def draft_table(model, seq: list[int], prompt_len: int, bs: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per decoded block: (first decoded slot, true tokens [bs], drafts [bs, bs]) where
    drafts[j, i] (i >= j) is the argmax for slot i at the state "slots < j true, >= j [MASK]"."""
    mask_id = model.mask_token_id
    first_block = prompt_len // bs * bs
    cache = model.new_cache(1)
    carry, _ = prefill_prompt_blocks(model, [seq[:prompt_len]], cache, bs)
    masks = block_diffusion(bs, device=model.device)
    out_blocks = []
    for b in range(first_block, len(seq), bs):
        true = seq[b : b + bs]
        if len(true) < bs:
            break
        start = max(0, prompt_len - b)
        states = torch.full((bs - start, bs), mask_id, dtype=torch.int64)
        for r, j in enumerate(range(start, bs)):
            states[r, :j] = torch.tensor(true[:j])
        drafts = np.full((bs, bs), -1, dtype=np.int64)
        for r, j in enumerate(range(start, bs)):
            pos = torch.arange(b, b + bs)[None]
            out = model(AttentionPlan(states[r : r + 1], pos, masks.words, cache), return_kv=False)
            logits = out.logits[0].float()
            if model.shifted:
                logits = torch.cat([carry, logits[:-1]], 0)
            drafts[j, j:] = logits.argmax(-1)[j:].numpy()
        out = model(
            AttentionPlan(torch.tensor([true]), torch.arange(b, b + bs)[None], masks.words, cache),
            return_kv=True,
            logits="last",
        )
        cache.append(out.suffix_kv, counts=[bs])
        carry = out.logits[:, -1].float()
        out_blocks.append((start, np.array(true), drafts))
    return out_blocks


def replay(blocks, bs: int) -> dict:
    """Greedy S2D2 ``always`` (alternating) and the copies variant on one draft table."""
    alt_f = alt_t = cop_f = cop_t = cop_rows = 0
    ready = False  # copies: the next block's drafts came with the last forward
    for start, true, drafts in blocks:
        # alternating: a drafting forward, then a verification forward, until the block is full
        j = start
        while j < bs:
            alt_f += 2
            k = 0
            while j + k < bs and drafts[j, j + k] == true[j + k]:
                k += 1
            alt_t += min(k + 1, bs - j)
            j += k + 1
        # copies: every forward verifies (a drafting forward only where no copy saw the state)
        j, src = start, start
        if not ready:
            cop_f += 1
        while j < bs:
            cop_f += 1
            cop_rows += (bs - j) + sum(bs - r for r in range(j, bs - 1)) + bs
            k = 0
            while j + k < bs and drafts[src, j + k] == true[j + k]:
                k += 1
            cop_t += min(k + 1, bs - j)
            ready = j + k == bs  # all accepted: the next block's copy is exact
            src = j + k
            j += k + 1
    return {
        "alt_forwards": alt_f,
        "alt_tokens": alt_t,
        "copies_forwards": cop_f,
        "copies_tokens": cop_t,
        "copies_rows": cop_rows,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--block-sizes", default="4,8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load("smollm2-135m-bd")
    target = dspec.load("smollm2-135m")
    sizes = [int(s) for s in args.block_sizes.split(",")]
    print("| set | block | alternating tokens/fwd | copies tokens/fwd | copies rows/fwd |")
    print("|---|---|---|---|---|")
    for pset, texts in grid_texts(target, args.prompts).items():
        refs = []
        for text in texts:
            prompt = target.tokenizer.encode(text)
            gen = dspec.generate(target, prompt, method="ar", max_new_tokens=args.max_new_tokens).tokens
            refs.append((prompt, gen))
        for bs in sizes:
            tot = dict.fromkeys(("alt_forwards", "alt_tokens", "copies_forwards", "copies_tokens", "copies_rows"), 0)
            for prompt, gen in refs:
                for key, v in replay(draft_table(model, prompt + gen, len(prompt), bs), bs).items():
                    tot[key] += v
            print(
                f"| {pset} | {bs} | {tot['alt_tokens'] / tot['alt_forwards']:.2f} | "
                f"{tot['copies_tokens'] / tot['copies_forwards']:.2f} | "
                f"{tot['copies_rows'] / tot['copies_forwards']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

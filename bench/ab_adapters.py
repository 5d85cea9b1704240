"""Two (or more) mask adapters of one base (``smollm2-135m-bd`` rounds), A/B in one process.

A mask-adapter round changes every block-diffusion method at once: ``ssd``, ``spiffy``,
``s2d2`` (self-speculative on the adapted model) and ``diffuspec`` (the adapted model drafts
for the base).  For every prompt of the e2e grid's sets (chat-wrapped as the grid wraps
them), greedy, batch 1: ``ar`` on the base, then per adapter one-token-per-step
``diffusion`` (block size = the adapter's), ``ssd``, ``spiffy`` (its graph calibrated on that
adapter on first use, as ``dspec`` does for any model), ``s2d2`` with ``policy="min_span"``
and ``"always"``, and ``diffuspec``, interleaved.  Reports per prompt set and pooled: tok/s
against ``ar`` and against the same adapter's one-token diffusion, mean accepted, tokens per
target forward, and the lossless checks (``ssd`` / ``spiffy`` = that diffusion,
``s2d2 always`` / ``diffuspec`` = ``ar``).

    python bench/ab_adapters.py --adapters smollm2-135m-bd,runs/bd-r5/adapter --prompts 8
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, run_interleaved, summary_rows
from common import environment, write_json
from dspec.hub import ADAPTED
from dspec.train.mask_adapter import load_mask_adapter


def load_adapted(name: str, base_name: str):
    """A shipped adapted model by name, or an adapter directory on a fresh copy of the base."""
    if name in ADAPTED:
        return dspec.load(name)
    return load_mask_adapter(dspec.load(base_name), name)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--adapters", required=True, help="comma-separated adapted names or adapter directories")
    add_run_arguments(ap, prompts=8, name="ab_adapters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dspec.load(args.base)
    arms = [Arm("ar", base, "ar")]
    vs_diffusion = {}
    for name in args.adapters.split(","):
        bd = load_adapted(name, args.base)
        ref = f"diffusion[{name}]"
        arms += [
            Arm(ref, bd, "diffusion", {"tokens_per_step": 1}),
            Arm(f"ssd[{name}]", bd, "ssd", reference=ref),
            Arm(f"spiffy[{name}]", bd, "spiffy", reference=ref),
            Arm(f"s2d2-min_span[{name}]", bd, "s2d2", {"policy": "min_span"}),
            Arm(f"s2d2-always[{name}]", bd, "s2d2", {"policy": "always"}, reference="ar"),
            Arm(f"diffuspec[{name}]", base, "diffuspec", {"drafter": bd}, reference="ar"),
        ]
        vs_diffusion.update({a.name: ref for a in arms[-6:]})
    acc = run_interleaved(arms, grid_texts(base, args.prompts), args.max_new_tokens)
    rows = summary_rows(arms, acc, {"ar": "ar", "diffusion": vs_diffusion})
    payload = {"bench": "ab_adapters", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

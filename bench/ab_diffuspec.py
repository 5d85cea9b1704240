"""DiffuSpec's CPU drafting changes on and off, A/B in one process on the e2e grid's prompts.

Two changes to the drafter's forward on the CPU, each switchable: the draft vocabulary
(``draft_vocab="auto"``: the head reads only the 16,384 most frequent response tokens) and
the shared KV cache (a mask-adapted target drafts against the target's cache: no pending
rows, no second commit).  Arms: ``ar``; ``diffuspec`` with neither (the path before both changes);
with the draft vocabulary only; with both (the default).  Interleaved per prompt, greedy,
batch 1; every arm's output must equal ``ar``'s.

    python bench/ab_diffuspec.py --prompts 8
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, run_interleaved, summary_rows
from common import environment, write_json
from dspec.decode import diffuspec


@contextlib.contextmanager
def own_cache():
    """The drafter keeps its own KV cache (re-forwards its pending tokens, commits them)."""
    saved = diffuspec.shares_target_cache
    diffuspec.shares_target_cache = lambda model, drafter: False
    try:
        yield
    finally:
        diffuspec.shares_target_cache = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    add_run_arguments(ap, prompts=8, name="ab_diffuspec")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.target)
    arms = [
        Arm("ar", model, "ar"),
        Arm(
            "diffuspec[full vocab, own cache]",
            model,
            "diffuspec",
            {"draft_vocab": None},
            reference="ar",
            scope=own_cache,
        ),
        Arm("diffuspec[own cache]", model, "diffuspec", reference="ar", scope=own_cache),
        Arm("diffuspec", model, "diffuspec", reference="ar"),
    ]
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    rows = summary_rows(arms, acc, {"ar": "ar", "before": {a.name: arms[1].name for a in arms[2:]}})
    payload = {"bench": "ab_diffuspec", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

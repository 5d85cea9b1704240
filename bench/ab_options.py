"""One method under several option sets, A/B in one process on the e2e grid's prompts.

For tuning a method's CPU defaults (``row_cost``, draft lengths, ...) by wall clock: this
VM's bandwidth moves between processes, so the option sets are interleaved per prompt with
the baseline (``ar`` on the target, one-token ``diffusion`` on a dLLM) in one run, greedy,
batch 1.  Each option set must reproduce the first one's output where the method is lossless
(rows count the prompts where it differs).

    python bench/ab_options.py --model smollm2-135m --method diffuspec \\
        --options '{}' '{"k_min": 4, "k_max": 12}' --prompts 4
    python bench/ab_options.py --method d2sd --options '{"tree": null}' '{}' --others dflash
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, option_sets, run_interleaved, summary_rows
from common import environment, write_json


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="shipped name or checkpoint directory")
    ap.add_argument("--method", required=True)
    ap.add_argument(
        "--options",
        nargs="+",
        required=True,
        metavar="JSON",
        help="option sets as JSON objects, e.g. '{}' '{\"row_cost\": 0.02}'",
    )
    ap.add_argument(
        "--others",
        default="",
        metavar="METHODS",
        help="comma-separated methods decoded beside, with their defaults (e.g. dflash next to d2sd)",
    )
    add_run_arguments(ap, prompts=8, name=None)  # default name: ab_<method>
    args = ap.parse_args(argv)
    sets = option_sets(ap, "--options", args.options)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.model)
    base = ("ar", {}) if model.attention == "causal" else ("diffusion", {"tokens_per_step": 1})
    arms = [Arm(base[0], model, base[0], base[1])]
    for other in filter(None, args.others.split(",")):
        arms.append(Arm(other, model, other, {}, reference=base[0] if base[0] == "ar" else None))
    first = None
    for opts in sets:
        name = f"{args.method}{json.dumps(opts, sort_keys=True)}"
        arms.append(Arm(name, model, args.method, opts, reference=first))
        first = first or name
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    rows = summary_rows(arms, acc, {base[0]: base[0]})
    payload = {"bench": "ab_options", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(
        Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name or 'ab_' + args.method}.json", payload
    )
    return payload


if __name__ == "__main__":
    main()

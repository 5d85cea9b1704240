"""Two (or more) DFlash drafters for one target, A/B in one process on the e2e grid's prompts.

This VM's memory bandwidth moves between processes, so a drafter round is judged against the
previous one inside one run: for every prompt (the e2e grid's sets, chat-wrapped as the grid
wraps them) ``ar``, then ``dflash`` and ``dflash-adaptive`` (row_cost 0.06) with each drafter,
both verifying the chain (``tree=None``), interleaved, greedy, batch 1.  Reports per prompt set and pooled:
tok/s, the ratio to ``ar``, tokens committed per verification (weighted by cycles) and outputs that differ from ``ar``'s
(``ab_common.py``).  ``--vp-drafters`` (one per DFlash drafter, in the same order, or any
number with one DFlash drafter) adds per pair the two D2SD settings of the e2e grid, K = 2,
re-drafting in every cycle (``redraft_min=0``): ``d2sd-chain`` (the papers': the first draft
a chain, no prompt-lookup branch; against ``dflash``, the chain) and ``d2sd-tree`` (the
CPU's: grafted onto DFlash's draft tree with the lookup branch), plus per DFlash drafter
``dflash-tree`` (``dflash`` at its CPU defaults, the tree's baseline); ``--tree N[,M..]`` a
``dflash`` arm per drafter and node count verifying a draft tree (at the CPU's default row cost).
``--verify-all``: the ``dflash``, ``dflash-tree`` and D2SD arms verify every drafted node
(``row_cost=None``) instead of pruning at the CPU's row cost -- acceptance as the papers count it.
``--d2sd-variants JSON ...`` adds a d2sd-chain arm per pair and JSON dict of d2sd options
(e.g. ``boundary_pool``, ``prior_weight``); ``--only`` keeps the arms whose names start with
the given prefixes (and ``ar``).

    python bench/ab_drafters.py --drafters smollm2-135m-dflash,runs/dflash-r6/drafter
    python bench/ab_drafters.py --drafters smollm2-135m-dflash --vp-drafters smollm2-135m-vp,runs/vp-r4/drafter
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, option_sets, run_interleaved, summary_rows
from common import environment, write_json
from dspec.models.dflash import resolve_drafter


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", required=True, help="comma-separated drafter names or directories")
    ap.add_argument(
        "--vp-drafters",
        default=None,
        help="comma-separated VP drafters, one per --drafters entry (or any number with one "
        "DFlash drafter): adds the d2sd-chain and d2sd-tree arms per pair",
    )
    ap.add_argument("--row-cost", type=float, default=0.06, help="dflash-adaptive's row_cost")
    ap.add_argument(
        "--tree",
        default=None,
        help="comma-separated node counts: a dflash arm per drafter and count verifying a draft tree",
    )
    ap.add_argument(
        "--verify-all",
        action="store_true",
        help="dflash / dflash-tree / d2sd arms verify every drafted node (row_cost=None)",
    )
    ap.add_argument(
        "--d2sd-variants",
        nargs="*",
        default=[],
        metavar="JSON",
        help="per DFlash / VP pair, one more d2sd-chain arm per JSON dict of d2sd options, e.g. "
        "'{\"boundary_pool\": 4}' '{\"prior_weight\": 1.0}'",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated arm-name prefixes to run (ar always runs), e.g. 'dflash[,d2sd-chain'",
    )
    add_run_arguments(ap, prompts=32, name="ab_drafters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.target)
    paths = args.drafters.split(",")
    vp_names = args.vp_drafters.split(",") if args.vp_drafters else []
    if len(paths) == 1:
        vps = [vp_names]  # every VP drafter against the one DFlash drafter
    elif not vp_names or len(vp_names) == len(paths):
        vps = [[v] for v in vp_names] or [[] for _ in paths]
    else:
        ap.error(f"--vp-drafters: one per --drafters entry ({len(paths)}) or any number with one, got {len(vp_names)}")
    try:
        trees = [int(n) for n in args.tree.split(",")] if args.tree else []
    except ValueError:
        ap.error(f"--tree: comma-separated ints, got {args.tree!r}")
    variants = option_sets(ap, "--d2sd-variants", args.d2sd_variants)
    full = {"row_cost": None} if args.verify_all else {}
    arms = [Arm("ar", model, "ar")]
    for path, vp_list in zip(paths, vps):
        d = resolve_drafter(path, model, "dflash")
        arms += [
            Arm(f"dflash[{path}]", model, "dflash", {"drafter": d, "tree": None, **full}, reference="ar"),
            Arm(
                f"adaptive[{path}]",
                model,
                "dflash",
                {"drafter": d, "row_cost": args.row_cost, "tree": None},
                reference="ar",
            ),
        ]
        for nodes in trees:
            arms.append(Arm(f"tree{nodes}[{path}]", model, "dflash", {"drafter": d, "tree": nodes}, reference="ar"))
        if vp_list:
            arms.append(Arm(f"dflash-tree[{path}]", model, "dflash", {"drafter": d, **full}, reference="ar"))
        for vp in vp_list:
            pair = {"dflash": d, "vp": resolve_drafter(vp, model, "vp")}
            arms += [
                Arm(
                    f"d2sd-chain[{path},{vp}]",
                    model,
                    "d2sd",
                    {"drafter": pair, "k": 2, "tree": None, "lookup": None, "redraft_min": 0, **full},
                    reference="ar",
                ),
                Arm(
                    f"d2sd-tree[{path},{vp}]",
                    model,
                    "d2sd",
                    {"drafter": pair, "k": 2, "redraft_min": 0, **full},
                    reference="ar",
                ),
            ]
            for extra in variants:
                label = ",".join(f"{key}={val}" for key, val in extra.items())
                arms.append(
                    Arm(
                        f"d2sd-chain{{{label}}}[{path},{vp}]",
                        model,
                        "d2sd",
                        {"drafter": pair, "k": 2, "tree": None, "lookup": None, "redraft_min": 0, **full, **extra},
                        reference="ar",
                    )
                )
    if args.only:
        prefixes = tuple(args.only.split(","))
        arms = [a for a in arms if a.name == "ar" or a.name.startswith(prefixes)]
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    rows = summary_rows(arms, acc, {"ar": "ar"})
    payload = {"bench": "ab_drafters", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

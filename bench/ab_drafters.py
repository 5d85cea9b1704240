"""Two (or more) DFlash drafters for one target, A/B in one process on the e2e grid's prompts.

This VM's memory bandwidth moves between processes, so a drafter round is judged against the
previous one inside one run: for every prompt (the e2e grid's sets, chat-wrapped as the grid
wraps them) ``ar``, then ``dflash`` and ``dflash-adaptive`` (row_cost 0.06) with each drafter,
interleaved, greedy, batch 1.  Reports per prompt set and pooled: tok/s, the ratio to ``ar``,
tokens committed per verification (weighted by cycles) and outputs that differ from ``ar``'s.

    python bench/ab_drafters.py --drafters smollm2-135m-dflash,runs/dflash-r6/drafter
Writes bench/results/cpu/<name>.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402

import dspec  # noqa: E402
from dspec.bench_e2e import CHAT_SETS, PROMPT_SETS, _prompts, is_chat_model  # noqa: E402
from dspec.models.dflash import resolve_drafter  # noqa: E402
from dspec.models.embedded import chat_prompt  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", required=True, help="comma-separated drafter names or directories")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per set (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--row-cost", type=float, default=0.06, help="dflash-adaptive's row_cost")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="ab_drafters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.target)
    drafters = {p: resolve_drafter(p, model, "dflash") for p in args.drafters.split(",")}
    prompts, _ = _prompts(list(PROMPT_SETS), args.prompts, 0)
    configs = [("ar", "ar", {})]
    for path, d in drafters.items():
        configs += [(f"dflash[{path}]", "dflash", {"drafter": d}),
                    (f"adaptive[{path}]", "dflash", {"drafter": d, "row_cost": args.row_cost})]
    for _, method, kw in configs:                                   # warm-up, untimed
        dspec.generate(model, "Hello", method=method, max_new_tokens=16, **kw)
    acc = defaultdict(lambda: defaultdict(float))
    from tqdm.auto import tqdm
    bar = tqdm(total=sum(len(v) for v in prompts.values()), desc="prompts")
    chat = is_chat_model(model)
    for pset, problems in prompts.items():
        for problem in problems:
            text = chat_prompt(problem.prompt) if chat and pset in CHAT_SETS else problem.prompt
            reference = None
            for name, method, kw in configs:
                t0 = time.perf_counter()
                g = dspec.generate(model, text, method=method, max_new_tokens=args.max_new_tokens, **kw)
                a = acc[(name, pset)]
                a["s"] += time.perf_counter() - t0
                a["tokens"] += len(g.tokens)
                cycles = g.stats.get("cycles", 0)
                a["cycles"] += cycles
                a["committed"] += g.stats.get("mean_accepted", 1.0) * cycles
                if reference is None:
                    reference = g.tokens
                a["differ"] += g.tokens != reference
            bar.update(1)
    bar.close()
    rows = []
    for name, _, _ in configs:
        for pset in [*prompts, "all"]:
            sets = list(prompts) if pset == "all" else [pset]
            a = {k: sum(acc[(name, s)][k] for s in sets) for k in ("s", "tokens", "cycles", "committed", "differ")}
            ar = {k: sum(acc[("ar", s)][k] for s in sets) for k in ("s", "tokens")}
            rate = a["tokens"] / a["s"]
            rows.append({"config": name, "prompt_set": pset, "tokens": int(a["tokens"]), "tok_s": round(rate, 2),
                         "vs_ar": round(rate / (ar["tokens"] / ar["s"]), 4),
                         "tokens_per_cycle": round(a["committed"] / a["cycles"], 4) if a["cycles"] else None,
                         "differ_from_ar": int(a["differ"])})
            r = rows[-1]
            print(f"{name:44s} {pset:10s} {r['tok_s']:7.1f} tok/s  x{r['vs_ar']:.3f}  "
                  f"per cycle {r['tokens_per_cycle'] or 0:.3f}  differ {r['differ_from_ar']}")
    payload = {"bench": "ab_drafters", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

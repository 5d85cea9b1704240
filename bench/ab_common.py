"""Same-process A/B of decoding configurations on the e2e grid's prompts.

This VM's memory bandwidth moves between processes, so a new artifact (a drafter round, an
adapter round) is judged against the previous one inside one run, the configurations
interleaved per prompt: every *arm* decodes prompt 1, then every arm prompt 2, ...  Each
arm may name a reference arm whose output it must equal (a lossless method against its
one-token-per-step reference); the rows count the prompts where it differs.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import dspec
from dspec.bench_e2e import PROMPT_SETS, _prompt_text, _prompts, is_chat_model

FIELDS = ("s", "tokens", "cycles", "committed", "target_forwards", "accepted_x_tokens", "differ")


@dataclass
class Arm:
    """One configuration: ``dspec.generate(model, text, method=method, **options)``."""

    name: str
    model: object
    method: str
    options: dict = field(default_factory=dict)
    reference: str | None = None  # the arm whose tokens this one must reproduce
    scope: Callable | None = None  # a context manager factory entered around each call


def add_run_arguments(ap, *, prompts: int, name: str | None) -> None:
    """The arguments every A/B script takes: prompts per set, tokens, threads, output name."""
    ap.add_argument("--prompts", type=int, default=prompts, help=f"prompts per set (default {prompts})")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=name, help="output JSON name under bench/results/cpu/")


def option_sets(ap, flag: str, values: list[str]) -> list[dict]:
    """Command-line option sets, each a JSON object of ``dspec.generate`` options (``ap.error``
    naming ``flag`` otherwise)."""
    try:
        sets = [json.loads(v) for v in values]
    except json.JSONDecodeError as e:
        ap.error(f"{flag}: not JSON ({e})")
    if not all(isinstance(s, dict) for s in sets):
        ap.error(f"{flag}: each must be a JSON object")
    return sets


def grid_texts(model, prompts_per_set: int, seed: int = 0) -> dict[str, list[str]]:
    """The e2e grid's prompt sets, chat-wrapped as the grid wraps them for ``model``."""
    prompts, _ = _prompts(list(PROMPT_SETS), prompts_per_set, seed)
    chat = is_chat_model(model)
    return {pset: [_prompt_text(chat, pset, p) for p in problems] for pset, problems in prompts.items()}


def run_interleaved(arms: list[Arm], texts: dict[str, list[str]], max_new_tokens: int) -> dict:
    """Decode every prompt with every arm (greedy, batch 1), arms interleaved per prompt,
    after one untimed warm-up call per arm; returns {(arm name, prompt set): totals}."""
    from tqdm.auto import tqdm

    names = [a.name for a in arms]
    for a in arms:
        if a.reference is not None and names.index(a.reference) > names.index(a.name):
            raise ValueError(f"arm {a.name!r}: its reference {a.reference!r} must come before it")

    def enter(a):
        return a.scope() if a.scope is not None else contextlib.nullcontext()

    for a in arms:
        with enter(a):
            dspec.generate(a.model, "Hello", method=a.method, max_new_tokens=16, **a.options)
    acc = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    bar = tqdm(total=sum(len(v) for v in texts.values()), desc="prompts")
    for pset, prompts in texts.items():
        for text in prompts:
            outputs = {}
            for a in arms:
                with enter(a):
                    t0 = time.perf_counter()
                    g = dspec.generate(a.model, text, method=a.method, max_new_tokens=max_new_tokens, **a.options)
                    row = acc[(a.name, pset)]
                    row["s"] += time.perf_counter() - t0
                row["tokens"] += len(g.tokens)
                cycles = g.stats.get("cycles", 0)
                row["cycles"] += cycles
                row["committed"] += g.stats.get("mean_accepted", 1.0) * cycles
                row["target_forwards"] += g.stats.get("nfe", {}).get("target", 0)
                row["accepted_x_tokens"] += g.stats.get("mean_accepted", 1.0) * len(g.tokens)
                outputs[a.name] = g.tokens
                if a.reference is not None:
                    row["differ"] += g.tokens != outputs[a.reference]
            bar.update(1)
    bar.close()
    return acc


def summary_rows(arms: list[Arm], acc: dict, baselines: dict[str, str | dict]) -> list[dict]:
    """Per arm and prompt set (and "all"): tok/s, the ratio to each baseline (``baselines``
    maps a column suffix to an arm name, or to {arm name: its baseline arm}), tokens per
    cycle (cycle-weighted), mean accepted (token-weighted), tokens per target forward and
    the prompts whose output differs from the arm's reference."""
    sets = sorted({s for _, s in acc}, key=list(PROMPT_SETS).index)
    rows = []

    def total(name, which):
        return {k: sum(acc[(name, s)][k] for s in which) for k in FIELDS}

    for a in arms:
        for pset in [*sets, "all"]:
            which = sets if pset == "all" else [pset]
            t = total(a.name, which)
            rate = t["tokens"] / t["s"]
            row = {
                "config": a.name,
                "method": a.method,
                "prompt_set": pset,
                "tokens": int(t["tokens"]),
                "tok_s": round(rate, 2),
            }
            for suffix, base in baselines.items():
                base = base.get(a.name) if isinstance(base, dict) else base
                if base is not None:
                    b = total(base, which)
                    row[f"vs_{suffix}"] = round(rate / (b["tokens"] / b["s"]), 4)
            row["tokens_per_cycle"] = round(t["committed"] / t["cycles"], 4) if t["cycles"] else None
            row["mean_accepted"] = round(t["accepted_x_tokens"] / t["tokens"], 4) if t["tokens"] else None
            row["tokens_per_target_forward"] = (
                round(t["tokens"] / t["target_forwards"], 4) if t["target_forwards"] else None
            )
            row["reference"] = a.reference
            row["differ_from_reference"] = int(t["differ"]) if a.reference else None
            rows.append(row)
            ratios = "  ".join(f"x{row[k]:.3f} {k[3:]}" for k in row if k.startswith("vs_"))
            print(
                f"{a.name:44s} {pset:10s} {rate:7.1f} tok/s  {ratios}  acc {row['mean_accepted'] or 0:.3f}  "
                f"per target fwd {row['tokens_per_target_forward'] or 0:.3f}  "
                f"differ {row['differ_from_reference'] if a.reference else '-'}",
                flush=True,
            )
    return rows

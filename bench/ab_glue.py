"""The decode-glue changes, on and off, A/B in one process on the e2e grid's prompts.

A speculative cycle on the CPU runs its host-side glue (tree building, verification
bookkeeping, KV commits, the drafter's context projection) right after a forward has
streamed ~300 MB of weights through the caches, where each small torch op costs ~10-60 us
cold instead of ~1-8 us warm.  This bench decodes every prompt with ``ar`` and, per method,
with the current glue (value checks trusted in decode loops, ``dspec._C.draft_tree``,
``dspec._C.commit_rows``, the drafter context in three C++ calls) and with those four turned
off (each falls back to the path it replaced: checks on, the torch composition, the index
commit, the per-op context projection), interleaved per prompt, greedy, batch 1.  Outputs
must equal ``ar``'s in both arms.

    python bench/ab_glue.py --prompts 8
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
import dspec.decode.dflash as dflash_mod
import dspec.models.kv_cache as kv_cache_mod
from ab_common import Arm, add_run_arguments, grid_texts, run_interleaved, summary_rows
from common import environment, write_json
from dspec import _validate
from dspec.models.dflash import BlockDrafter


@contextlib.contextmanager
def glue_off():
    """The four glue changes off (the paths they replaced)."""
    saved = (
        _validate.config.trust_decode,
        dflash_mod._backend,
        kv_cache_mod._commit_rows_cpu,
        BlockDrafter._context_kv_fused,
    )
    _validate.config.trust_decode = False
    dflash_mod._backend = SimpleNamespace(extension=lambda: None)  # draft_tree: the composition
    kv_cache_mod._commit_rows_cpu = lambda *args: False  # the index commit
    BlockDrafter._context_kv_fused = lambda self, *args: None  # the per-op context K / V
    try:
        yield
    finally:
        (
            _validate.config.trust_decode,
            dflash_mod._backend,
            kv_cache_mod._commit_rows_cpu,
            BlockDrafter._context_kv_fused,
        ) = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", default="dflash,d2sd", help="comma-separated methods on the target")
    add_run_arguments(ap, prompts=8, name="ab_glue")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.target)
    arms = [Arm("ar", model, "ar")]
    for method in args.methods.split(","):
        arms += [
            Arm(f"{method}[glue off]", model, method, reference="ar", scope=glue_off),
            Arm(method, model, method, reference="ar"),
        ]
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    glue_off_of = {a.name: f"{a.name}[glue off]" for a in arms if "[" not in a.name and a.name != "ar"}
    baselines = {"ar": "ar", "glue_off": glue_off_of}
    rows = summary_rows(arms, acc, baselines)
    payload = {"bench": "ab_glue", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

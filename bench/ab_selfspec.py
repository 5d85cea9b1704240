"""The self-speculative engine's compiled round (``dspec._C.selfspec_*``) on and off, A/B in
one process on the e2e grid's prompts.

``ssd`` and ``spiffy`` run on the block-diffusion model (``smollm2-135m-bd``) against
one-token-per-step ``diffusion`` (their lossless reference), each with the round's host-side
work in three compiled calls and with the torch composition it replaced (~200 small ops a
round, run cold right after the forward has streamed the weights), interleaved per prompt,
greedy, batch 1.  Outputs must equal the reference's in both arms.

    python bench/ab_selfspec.py --prompts 8
Writes bench/results/cpu/<name>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_common import Arm, add_run_arguments, grid_texts, run_interleaved, summary_rows  # noqa: E402
from common import environment, write_json  # noqa: E402

import dspec  # noqa: E402
from dspec.decode import _selfspec  # noqa: E402


@contextlib.contextmanager
def compiled_round_off():
    """The engine's torch composition instead of the compiled round."""
    init = _selfspec._Engine.__init__

    def torch_round(self, *args, **kw):
        init(self, *args, **kw)
        self.native = None
    _selfspec._Engine.__init__ = torch_round
    try:
        yield
    finally:
        _selfspec._Engine.__init__ = init


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-bd")
    ap.add_argument("--methods", default="ssd,spiffy", help="comma-separated self-speculative methods")
    add_run_arguments(ap, prompts=8, name="ab_selfspec")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.model)
    ref = "diffusion-static-1"
    arms = [Arm(ref, model, "diffusion", {"tokens_per_step": 1})]
    for method in args.methods.split(","):
        arms += [Arm(f"{method}[torch round]", model, method, reference=ref, scope=compiled_round_off),
                 Arm(method, model, method, reference=ref)]
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    torch_of = {a.name: f"{a.name}[torch round]" for a in arms if "[" not in a.name and a.name != ref}
    rows = summary_rows(arms, acc, {"diffusion": ref, "torch_round": torch_of})
    payload = {"bench": "ab_selfspec", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

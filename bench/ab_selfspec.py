"""The compiled host-side steps of the self-speculative methods on and off, A/B in one process
on the e2e grid's prompts.

``ssd`` and ``spiffy`` run on the block-diffusion model (``smollm2-135m-bd``) against
one-token-per-step ``diffusion`` (their lossless reference), each with the round's host-side
work in three compiled calls (``dspec._C.selfspec_*``) and with the torch composition it
replaced (~200 small ops a round, run cold right after the forward has streamed the
weights); ``s2d2`` (policy ``always``, ``dspec._C.s2d2_*`` against its torch step of several
hundred small ops) against ``ar`` on the target (``smollm2-135m``), its lossless reference.  Interleaved per
prompt, greedy, batch 1.  Outputs must equal the reference's in both arms.

    python bench/ab_selfspec.py --prompts 8
    python bench/ab_selfspec.py --methods s2d2 --prompts 8 --name ab_s2d2_native
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
from dspec.decode import s2d2, selfspec


@contextlib.contextmanager
def compiled_round_off():
    """The torch compositions instead of the compiled rounds / steps."""
    init, native = selfspec.SelfSpecEngine.__init__, s2d2.native_extension

    def torch_round(self, *args, **kw):
        init(self, *args, **kw)
        self.native = None

    selfspec.SelfSpecEngine.__init__ = torch_round
    s2d2.native_extension = lambda *a: None
    try:
        yield
    finally:
        selfspec.SelfSpecEngine.__init__ = init
        s2d2.native_extension = native


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-bd")
    ap.add_argument("--target", default="smollm2-135m", help="the AR model s2d2's output must equal")
    ap.add_argument("--methods", default="ssd,spiffy", help="comma-separated: ssd, spiffy, s2d2")
    add_run_arguments(ap, prompts=8, name="ab_selfspec")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.model)
    methods = args.methods.split(",")
    refs = {"ssd": "diffusion-static-1", "spiffy": "diffusion-static-1", "s2d2": "ar"}
    if any(m not in refs for m in methods):
        ap.error(f"--methods: each one of {sorted(refs)}")
    arms = []
    if any(refs[m] == "diffusion-static-1" for m in methods):
        arms.append(Arm("diffusion-static-1", model, "diffusion", {"tokens_per_step": 1}))
    if "s2d2" in methods:
        arms.append(Arm("ar", dspec.load(args.target), "ar"))
    for method in methods:
        options = {"policy": "always"} if method == "s2d2" else {}
        arms += [
            Arm(f"{method}[torch round]", model, method, options, reference=refs[method], scope=compiled_round_off),
            Arm(method, model, method, options, reference=refs[method]),
        ]
    acc = run_interleaved(arms, grid_texts(model, args.prompts), args.max_new_tokens)
    torch_of = {a.name: f"{a.name}[torch round]" for a in arms if a.name in refs}
    rows = summary_rows(arms, acc, {"reference": {m: refs[m] for m in methods}, "torch_round": torch_of})
    payload = {"bench": "ab_selfspec", "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

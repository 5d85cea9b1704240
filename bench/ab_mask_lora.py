"""The mask adapter's update on AMX tiles against the AVX-512 code, end to end: the dLLM
methods on ``smollm2-135m-bd`` with both, A/B in one process (arms interleaved per prompt).

The ``avx512`` arms load a second copy of the model whose adapted projections offer no packed
adapter (``MaskLoraLinear.lora_packed`` -> None), so ``dspec._C.mask_lora`` runs its AVX-512
code there; the ``amx`` arms run what ``dspec.load`` gives on this CPU.  In bf16 the two round
differently (their outputs may differ); each arm's losslessness against one-token diffusion is
checked within its own model.

    python bench/ab_mask_lora.py [--prompts 4] [--max-new-tokens 128]
Writes bench/results/cpu/ab_mask_lora.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, run_interleaved, summary_rows
from common import environment, write_json

CONFIGS = (
    ("diffusion-static-1", "diffusion", {"tokens_per_step": 1}),
    ("ssd", "ssd", {}),
    ("ssd-d2", "ssd", {"draft_len": 2, "mixed_order": False}),
    ("s2d2-always", "s2d2", {"policy": "always"}),
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-bd")
    add_run_arguments(ap, prompts=4, name="ab_mask_lora")
    args = ap.parse_args(argv)
    from dspec.cpu import apply_threads
    from dspec.models.mask_adapter import MaskLoraLinear

    apply_threads(args.threads)
    amx = dspec.load(args.model)
    avx = dspec.load(args.model)
    for m in avx.modules():
        if isinstance(m, MaskLoraLinear):
            m.lora_packed = lambda: None
    packed = any(m.lora_packed() is not None for m in amx.modules() if isinstance(m, MaskLoraLinear))
    arms = []
    for kind, model in (("amx", amx), ("avx512", avx)):
        for name, method, options in CONFIGS:
            ref = None if name == "diffusion-static-1" or method == "s2d2" else f"diffusion-static-1 {kind}"
            arms.append(Arm(f"{name} {kind}", model, method, options, reference=ref))
    arms.sort(key=lambda a: a.reference is not None)  # references first
    texts = grid_texts(amx, args.prompts)
    acc = run_interleaved(arms, texts, args.max_new_tokens)
    rows = summary_rows(
        arms,
        acc,
        {
            "avx512": {f"{c[0]} amx": f"{c[0]} avx512" for c in CONFIGS},
            "one_token_diffusion": {a.name: f"diffusion-static-1 {a.name.split()[1]}" for a in arms},
        },
    )
    payload = {
        "bench": "ab_mask_lora",
        "env": environment("cpu"),
        "packed_adapter": packed,
        "configs": [list(c[:2]) + [c[2]] for c in CONFIGS],
        "rows": rows,
    }
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

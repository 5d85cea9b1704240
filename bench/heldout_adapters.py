"""Mask adapters on one held-out split: masked-token loss and argmax agreement with the base.

The trainer's held-out numbers of two rounds are comparable only on the same sequences and
the same noise.  This evaluates each adapter exactly as ``MaskAdapterTrainer.evaluate`` does
(fixed noise per block size) on the held-out split that ``--heldout-start`` selects from the
data directories: ``bs{b}`` the data tokens' cross-entropy (nats), ``agree_bs{b}`` the
fraction of those masked slots whose argmax is the base model's given the true prefix --
what a greedy S2D2 verification accepts token by token.

    python bench/heldout_adapters.py --adapters smollm2-135m-bd,runs/bd-r7/adapter \\
        --data data/smollm2-135m,data/smollm2-135m-math-code --heldout-start 28672
Writes bench/results/cpu/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from common import environment, write_json
from dspec.hub import ADAPTED, adapter_dir
from dspec.train.data_engine import read_directories
from dspec.train.lora import base_fingerprint
from dspec.train.mask_adapter import MaskAdapterConfig, MaskAdapterTrainer, load_mask_adapter


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", required=True, help="comma-separated adapter directories or shipped names")
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="data-engine directories, comma-separated (as in training)")
    ap.add_argument("--heldout-start", type=int, default=0)
    ap.add_argument("--heldout-sequences", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="heldout_adapters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sequences, info = read_directories(args.data.split(","))
    cfg = MaskAdapterConfig(heldout_start=args.heldout_start, heldout_sequences=args.heldout_sequences)
    rows = []
    for name in args.adapters.split(","):
        base = dspec.load(args.base, dtype="float32")  # fresh: training conversions change weights in place
        fingerprint = base_fingerprint(base)
        model = load_mask_adapter(base, adapter_dir(name) if name in ADAPTED else name)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = MaskAdapterTrainer(
                model, sequences, cfg, tmp, base_name=args.base, base_fingerprint=fingerprint, progress=False
            )
            trainer.evaluate()
        record = dict(trainer.evals[-1], adapter=name)
        record.pop("step")
        rows.append(record)
        print(name, {k: round(v, 4) for k, v in record.items() if isinstance(v, float)})
    payload = {
        "bench": "heldout_adapters",
        "env": environment("cpu"),
        "config": vars(args),
        "data": {k: info[k] for k in ("sequences", "tokens", "response_tokens") if k in info},
        "rows": rows,
    }
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

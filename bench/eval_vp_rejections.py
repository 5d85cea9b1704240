"""VP drafters at DFlash's rejections, on the e2e grid's own outputs (teacher-forced, greedy).

D2SD's re-draft at boundary i changes the output only where the first draft is rejected at
slot i + 1.  The VP recipe's held-out evaluation (``--prefix rejection``) measures that on
held-out *training-distribution* sequences; this script measures it where it counts: ``ar``
continues the grid's prompts (its sets, chat-wrapped as the grid wraps them, greedy, so the
sequences are what greedy verification commits), the shipped DFlash drafter drafts M blocks
per sequence at seeded anchors, and every VP drafter re-drafts each block from the true
rejection point, its rejected draft banned (:func:`dspec.train.dflash.rejection_prefixes`).
Reports per prompt set and pooled, per VP drafter: tokens a re-draft at the true rejection
boundary commits (accepted re-drafted slots + the target's token), the share of blocks with a
rejection and the weighted loss; and for the first drafter, how often D2SD's K boundaries
(``dspec.rejection_boundaries`` of its confidences, K in ``--boundary-k``) hold the true
rejection point -- D2SD's gain per rejected block is about that rate times the re-draft's
accepted slots.

    python bench/eval_vp_rejections.py --vp-drafters smollm2-135m-vp,runs/vp-r4/drafter --prompts 16

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
from ab_common import grid_texts
from common import environment, write_json
from dspec.models.dflash import load_drafter, resolve_drafter
from dspec.ops import rejection_boundaries
from dspec.train.dflash import (
    DrafterTrainConfig,
    DrafterTrainer,
    make_blocks,
    pad_sequences,
    rejection_prefixes,
    target_hidden,
)


def grid_sequences(model, prompts_per_set: int, max_new_tokens: int) -> tuple[list, list[str]]:
    """[(prompt + ``ar`` continuation ids, prompt length)] and each one's prompt set."""
    from tqdm.auto import tqdm

    seqs, sets = [], []
    texts = grid_texts(model, prompts_per_set)
    with tqdm(total=sum(len(v) for v in texts.values()), desc="ar on the grid's prompts") as bar:
        for pset, prompts in texts.items():
            for text in prompts:
                ids = list(model.tokenizer.encode(text))
                out = dspec.generate(model, text, method="ar", max_new_tokens=max_new_tokens).tokens
                seqs.append((ids + list(out), len(ids)))
                sets.append(pset)
                bar.update(1)
    return seqs, sets


def rejection_eval(model, first, vp, sequences, *, anchors: int, work: Path) -> dict:
    """The VP recipe's rejection-mode evaluation of drafter ``vp`` over every sequence."""
    cfg = DrafterTrainConfig(
        kind="vp",
        num_layers=vp.config.num_layers,
        block_size=vp.block_size,
        prefix_mode="rejection",
        anchors_per_seq=anchors,
        heldout_fraction=0.5,
    )
    trainer = DrafterTrainer(
        model, cfg, work, sequences=sequences, first_drafter=first, features=work / "features", progress=False
    )
    trainer.drafter.load_state_dict(vp.state_dict())
    if vp.draft_vocab is not None:  # the VP's own vocabulary, not one of these few sequences
        trainer.use_draft_vocab(vp.draft_vocab)
    trainer.held_idx = list(range(len(sequences)))
    trainer.evaluate(max_sequences=len(sequences))
    return trainer.evals[-1]


@torch.no_grad()
def boundary_hits(model, first, sequences, *, anchors: int, ks: list[int], batch: int = 8) -> dict:
    """Over blocks wholly inside their sequence that the first draft gets wrong: the share
    whose true rejection point is among the top-K ``rejection_boundaries`` (per K)."""
    g = first.block_size
    hits, rejected, blocks_in = dict.fromkeys(ks, 0), 0, 0
    for i in range(0, len(sequences), batch):
        tokens, lengths, plens = pad_sequences(sequences[i : i + batch], model.device)
        gen = torch.Generator().manual_seed(i)
        blocks, labels, valid, starts, _ = make_blocks(
            tokens, lengths, plens, block_size=g, anchors=anchors, generator=gen
        )
        hidden = target_hidden(model, tokens, first.target_layer_ids)
        prefix, _, has, logits = rejection_prefixes(
            first, hidden, lengths, blocks, labels, valid, starts, return_logits=True
        )
        inside = valid[..., 1:].all(-1)
        wrong = inside & has
        conf = logits.float().softmax(-1).amax(-1)[..., 1:].reshape(-1, g - 1)
        for k in ks:
            top = rejection_boundaries(conf, k)[0].view(*prefix.shape, k)
            hits[k] += int(((top == prefix[..., None]).any(-1) & wrong).sum())
        rejected += int(wrong.sum())
        blocks_in += int(inside.sum())
    return {
        "blocks": blocks_in,
        "rejected": rejected,
        **{f"hit_top{k}": round(hits[k] / max(rejected, 1), 4) for k in ks},
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dflash-drafter", default=None, help="the first drafter (default: the shipped one)")
    ap.add_argument("--vp-drafters", required=True, help="comma-separated VP drafter names or directories")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=64, help="blocks drawn per sequence (default %(default)s)")
    ap.add_argument("--boundary-k", default="1,2,4", help="K values of the boundary hit rate (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="vp_rejections_grid")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.target)
    first = resolve_drafter(args.dflash_drafter, model, "dflash")
    seqs, sets = grid_sequences(model, args.prompts, args.max_new_tokens)
    ks = [int(k) for k in args.boundary_k.split(",")]
    rows, boundaries = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pset in [*dict.fromkeys(sets), "all"]:
            part = [s for s, p in zip(seqs, sets) if pset in ("all", p)]
            boundaries.append({"prompt_set": pset, **boundary_hits(model, first, part, anchors=args.anchors, ks=ks)})
            print(f"{'boundaries (first drafter)':40s} {pset:11s} {boundaries[-1]}", flush=True)
            for name in args.vp_drafters.split(","):
                vp = load_drafter(name, model, kind="vp")
                rec = rejection_eval(model, first, vp, part, anchors=args.anchors, work=Path(tmp) / pset)
                rows.append(
                    {
                        "vp_drafter": name,
                        "prompt_set": pset,
                        "sequences": len(part),
                        "redraft_tokens": round(rec["heldout_accepted"], 4),
                        "rejected_fraction": round(rec["rejected_fraction"], 4),
                        "loss": round(rec["heldout_loss"], 4),
                        "slot_accuracy": rec["slot_accuracy"],
                    }
                )
                print(
                    f"{name:40s} {pset:11s} re-draft commits {rows[-1]['redraft_tokens']:.3f}  "
                    f"rejected {rows[-1]['rejected_fraction']:.3f}  loss {rows[-1]['loss']:.3f}",
                    flush=True,
                )
    payload = {
        "bench": "eval_vp_rejections",
        "env": environment("cpu"),
        "config": vars(args),
        "rows": rows,
        "boundaries": boundaries,
    }
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

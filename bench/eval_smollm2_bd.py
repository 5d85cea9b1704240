"""Evaluate a mask-selective block-diffusion adapter of SmolLM2-135M (``smollm2-135m-bd``).

Checks and measures, on held-out prompts (arithmetic seed-0 problems, HumanEval and MT-Bench
starts, none in the data engine's sources):

1. exactness in float32: logits of mask-free forwards (a ragged batch of prompts, and a
   cached continuation) equal ``smollm2-135m``'s bit for bit; ``diffusion`` at block size 1,
   one token per step, equals ``ar`` token for token; ``s2d2 policy="always"`` equals ``ar``;
2. arithmetic accuracy (``--problems`` seed-0 problems): ``ar`` vs one-token-per-step
   ``diffusion`` at block size 4, in the default CPU dtype;
3. acceptance (greedy, ``--prompts`` held-out prompts, ``--new`` tokens): ``ssd`` mean
   accepted, ``s2d2`` tokens per target forward, one-token-per-step ``diffusion`` forwards.

Writes ``eval.json`` (and with ``--card``, the model card ``README.md``) into the adapter
directory.  Usage::

    python bench/eval_smollm2_bd.py --adapter runs/bd/adapter [--card] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", required=True, help="adapter directory (adapter_config.json + adapter.safetensors)")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a few problems / prompts (a smoke test)")
    ap.add_argument("--card", action="store_true", help="also write the model card README.md")
    ap.add_argument("--threads", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.problems, args.prompts, args.new = 16, 2, 24
    import dspec
    from dspec import tasks
    from dspec.cpu import apply_threads, machine
    from dspec.models.embedded import chat_prompt
    from dspec.train.mask_adapter import load_mask_adapter

    apply_threads(args.threads)
    adapter = Path(args.adapter)
    out = {"adapter": str(adapter), "machine": machine(), "args": vars(args)}
    t0 = time.perf_counter()

    # 1. exactness, float32
    base = dspec.load("smollm2-135m", dtype="float32")
    bd = load_mask_adapter(base, adapter)
    tok = base.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        chat_prompt("Name three primary colors."),
        "Compute: 12 + 35 =",
    ]
    seqs = [tok.encode(t) for t in texts]
    with torch.no_grad():
        a = base(base.plan(seqs)).logits
        b = bd(bd.plan(seqs)).logits
        exact = {"prompt_logits_equal": bool(torch.equal(a, b))}
        cb, cm = base.new_cache(len(seqs)), bd.new_cache(len(seqs))
        lens = torch.tensor([len(s) for s in seqs])
        for model, cache in ((base, cb), (bd, cm)):
            o = model(model.plan(seqs, cache))
            cache.append(o.suffix_kv, counts=lens)
        nxt = [tok.encode(" and then")] * len(seqs)
        exact["cached_logits_equal"] = bool(torch.equal(base(base.plan(nxt, cb)).logits, bd(bd.plan(nxt, cm)).logits))
    ref = [g.tokens for g in dspec.generate(base, texts, method="ar", max_new_tokens=args.new)]
    d1 = [g.tokens for g in dspec.generate(bd, texts, method="diffusion", max_new_tokens=args.new, block_size=1)]
    s2 = [
        g.tokens
        for g in dspec.generate(
            bd, texts, method="s2d2", max_new_tokens=args.new, block_size=args.block_size, policy="always"
        )
    ]
    exact.update(diffusion_bs1_equals_ar=d1 == ref, s2d2_always_equals_ar=s2 == ref)
    out["exact_fp32"] = exact
    print("exactness:", exact, flush=True)
    del base, bd

    # 2. arithmetic accuracy and 3. acceptance, default dtype
    base = dspec.load("smollm2-135m")
    bd = load_mask_adapter(base, adapter)
    out["dtype"] = str(bd.dtype).replace("torch.", "")
    problems = tasks.prompt_set("arithmetic", args.problems, seed=0)
    acc = {}
    for name, model, opts in (
        ("ar", base, {"method": "ar"}),
        (f"diffusion_bs{args.block_size}", bd, {"method": "diffusion", "block_size": args.block_size}),
    ):
        t = time.perf_counter()
        gens = dspec.generate(model, [p.prompt for p in problems], max_new_tokens=6, **opts)
        ok = sum(tasks.check_arithmetic(p, g.text) for p, g in zip(problems, gens))
        acc[name] = {
            "correct": ok,
            "of": len(problems),
            "accuracy": ok / len(problems),
            "seconds": round(time.perf_counter() - t, 1),
        }
        print(name, acc[name], flush=True)
    acc["kept_fraction"] = acc[f"diffusion_bs{args.block_size}"]["accuracy"] / max(acc["ar"]["accuracy"], 1e-9)
    out["arithmetic"] = acc

    held = [p.prompt for p in tasks.humaneval()[: args.prompts // 2]] + [
        chat_prompt(p.prompt) for p in tasks.mtbench()[: args.prompts - args.prompts // 2]
    ]
    rows = {}
    for name, model, opts in (
        ("ar", base, {"method": "ar"}),
        ("diffusion", bd, {"method": "diffusion", "block_size": args.block_size}),
        ("ssd", bd, {"method": "ssd", "block_size": args.block_size}),
        ("s2d2", bd, {"method": "s2d2", "block_size": args.block_size}),
    ):
        t = time.perf_counter()
        gens = [dspec.generate(model, p, max_new_tokens=args.new, **opts) for p in held]
        n_tok = sum(len(g.tokens) for g in gens)
        fwd = sum(g.stats["nfe"].get("target", sum(g.stats["nfe"].values())) for g in gens)
        rows[name] = {
            "tokens": n_tok,
            "target_forwards": fwd,
            "tokens_per_forward": n_tok / max(fwd, 1),
            "mean_accepted": sum(g.stats.get("mean_accepted", 0.0) for g in gens) / len(gens),
            "seconds": round(time.perf_counter() - t, 1),
        }
        print(name, rows[name], flush=True)
    rows["samples"] = {
        p[:60]: g.text[:200]
        for p, g in zip(
            held[:2],
            [
                dspec.generate(bd, p, method="diffusion", max_new_tokens=args.new, block_size=args.block_size)
                for p in held[:2]
            ],
        )
    }
    out["acceptance"] = rows
    out["eval_seconds"] = round(time.perf_counter() - t0, 1)
    (adapter / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    if args.card:
        (adapter / "README.md").write_text(model_card(adapter, out))
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    return out


def model_card(adapter: Path, ev: dict) -> str:
    """The model card of the adapter: data, training, held-out numbers, the commands."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    meta = cfg.get("meta", {})
    data, train = meta.get("data", {}), meta.get("config", {})
    held = meta.get("heldout") or {}
    mach = ev["machine"]
    acc, rows, exact = ev["arithmetic"], ev["acceptance"], ev["exact_fp32"]
    bs = ev["args"]["block_size"]
    lines = [
        "# smollm2-135m-bd: SmolLM2-135M-Instruct as a self-speculative block-diffusion model",
        "",
        "A **mask-selective** adapter (`dspec.models.mask_adapter`): rank-"
        f"{cfg['rank']} LoRA on {', '.join(cfg['targets'])} of all 30 layers, applied only at [MASK] rows, "
        f"plus a trained input-only [MASK] embedding (the unused `<filename>` id {cfg['mask_token_id']}; the "
        "tied output head is untouched).  Clean tokens attend causally, so every forward without a [MASK] "
        "is SmolLM2-135M-Instruct bit for bit.  Right-shifted (Fast-dLLM v2 style) block diffusion, "
        f"default block size {cfg['block_size']}; {cfg['num_parameters']:,} adapter parameters, bf16.",
        "",
        "## Data",
        f"- {data.get('source', '?')}: {data.get('sequences', '?')} sequences, {data.get('tokens', '?')} tokens "
        f"({data.get('response_tokens', '?')} response tokens) from prompt sources {data.get('sources')} "
        f"(benchmark prompts excluded), {data.get('sampled_fraction')} of the calls sampled at T = 1; "
        "the loss covers response tokens.",
        "",
        "## Training",
        f"- {meta.get('step')} steps of {train.get('batch_size')} sequences (<= {train.get('max_len')} tokens), "
        f"block sizes {train.get('block_sizes')} (weights {train.get('block_weights')}), AdamW lr "
        f"{train.get('lr')} -> {train.get('min_lr')}, bf16 autocast where native; wall time "
        f"{(meta.get('wall_s') or 0) / 60:.1f} min on {mach.get('cpu_model')} ({mach.get('cores')} cores, flags "
        f"{' '.join(mach.get('cpu_flags', []))}).",
        "- held-out masked-token loss (nats, fixed noise): "
        + ", ".join(f"block {k[2:]}: {v:.3f}" for k, v in held.items() if k.startswith("bs")),
        "",
        "## Evaluation (`bench/eval_smollm2_bd.py`)",
        f"- exact in float32: {exact}",
        f"- arithmetic ({acc['ar']['of']} held-out seed-0 problems): `ar` {acc['ar']['accuracy']:.1%}, one-token-per-"
        f"step `diffusion` at block size {bs}: {acc[f'diffusion_bs{bs}']['accuracy']:.1%} "
        f"(kept {acc['kept_fraction']:.0%} of `ar`)",
        f"- greedy, {ev['args']['prompts']} HumanEval / MT-Bench prompts, {ev['args']['new']} new tokens, block size "
        f"{bs}, {ev['dtype']}: "
        + "; ".join(
            f"`{k}` {v['tokens_per_forward']:.2f} tokens per forward (mean accepted "
            f"{v['mean_accepted']:.2f}, {v['tokens'] / max(v['seconds'], 1e-9):.1f} tok/s)"
            for k, v in rows.items()
            if k != "samples"
        ),
        "",
        "## Reproduce",
        "```bash",
        "python -m dspec.train.data_engine --target smollm2-135m --out data/smollm2-135m",
        "python -m dspec.train.mask_adapter --base smollm2-135m --data data/smollm2-135m --out runs/bd "
        "--minutes M [--resume]",
        "python bench/eval_smollm2_bd.py --adapter runs/bd/adapter --card",
        "```",
        "A 135M model adapted on a CPU in under an hour: weak, for measuring the methods, not for quality claims.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

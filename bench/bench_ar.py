"""Autoregressive decoding on the CPU: dspec's `ar` against transformers' `generate` (same
weights, same dtype, greedy, same prompts) at batch 1 / 4 / 16, and llama.cpp (through
llama-cpp-python, on the GGUF SmolLM2 ships: Q4_1, 4-bit weights) at batch 1 when it is
installed; the weight-streaming floor (weights' bytes / DRAM read bandwidth) from the same
run.

tokens/s counts generated tokens (up to and including EOS) of all requests / wall time of
the call, prefill included; the same prompts (HumanEval, raw text) for every engine.  For
dspec the decode step alone is timed too (``decode_step_ms``: one token per request after
the prompts, prefill excluded), the rate batching is about.  ``--methods dflash`` also times
lossless dspec methods at batch 1 on the same prompts (greedy: the tokens must equal `ar`'s,
recorded as ``equal_to_ar``), so dspec's fastest lossless decode meets llama.cpp in one run.

    python bench/bench_ar.py [--batches 1,4,16] [--tokens 64] [--dtype float32] [--methods dflash]
Writes bench/results/cpu/ar.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, measure_bandwidth, out_dir, write_json


def _prompts(n: int) -> list[str]:
    from dspec.tasks import prompt_set

    return [p.prompt for p in prompt_set("humaneval", n)]


def run_dspec(model, prompts, tokens, method="ar"):
    import dspec

    t0 = time.perf_counter()
    outs = dspec.generate(model, prompts, method=method, max_new_tokens=tokens)
    wall = time.perf_counter() - t0
    return sum(len(o.tokens) for o in outs), wall, [o.tokens for o in outs]


def dspec_step_ms(model, prompts, steps: int = 16) -> float:
    from dspec import cpu

    with torch.no_grad(), cpu.torch_ops_one_thread():  # as generate runs a step
        return _dspec_step_ms(model, prompts, steps)


def _dspec_step_ms(model, prompts, steps: int) -> float:
    """Median ms of one batched decode step (forward of one token per request after the
    prompts' cache + commit + the greedy choice `ar` makes), prefill excluded."""
    from dspec.decode.sampling import next_tokens

    ids = [model.tokenizer.encode(p) for p in prompts]
    cache = model.new_cache(len(ids))
    plan = model.plan(ids, cache)
    out = model(plan, logits="last")
    cache.append(out.suffix_kv, counts=plan.lengths)
    # not torch's argmax: 1 ms for 16 x 49152 float32 rows on this CPU, 6% of a batch-16 step
    tok = next_tokens(out.logits[:, -1], 0.0, None)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(model.plan(tok[:, None], cache), logits="last")
        cache.append(out.suffix_kv, counts=[1] * len(ids))
        tok = next_tokens(out.logits[:, -1], 0.0, None)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_hf(hf, tok, prompts, tokens):
    enc = tok(prompts, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1] :].tolist()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in gen:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return sum(len(r) for r in rows), wall, rows


def run_llama(llm, prompts, tokens):
    count, wall = 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = llm(p, max_tokens=tokens, temperature=0.0, top_k=1)
        wall += time.perf_counter() - t0
        count += out["usage"]["completion_tokens"]
    return count, wall, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default: dspec.load's choice for this CPU")
    p.add_argument("--calls", type=int, default=3, help="timed calls per cell (median)")
    p.add_argument("--threads", default=None)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument(
        "--methods",
        default="",
        help="comma-separated lossless dspec methods timed beside `ar` at batch 1 on the same "
        "prompts (e.g. dflash: the shipped drafter), each checked equal to `ar` token for token",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="ar")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    import dspec
    from dspec.cpu import apply_threads, loadavg
    from dspec.models.embedded import smollm2_gguf_path

    threads = apply_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    model = dspec.load("smollm2-135m", dtype=args.dtype)
    dtype = model.dtype
    env = environment("cpu")
    bw = measure_bandwidth("cpu")
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    floor_ms = weight_bytes / (bw["read_GBs"] * 1e6)
    print(
        f"{env['cpu']['cpu_model']} {env['cpu']['cpu_flags']}; {threads} threads; {dtype}; DRAM read "
        f"{bw['read_GBs']:.1f} GB/s -> floor {floor_ms:.1f} ms/step ({1e3 / floor_ms:.1f} tok/s at batch 1)",
        flush=True,
    )
    engines = {"dspec": lambda ps: run_dspec(model, ps, args.tokens)}
    methods = [m for m in args.methods.split(",") if m and m != "ar"]
    for m in methods:
        engines[f"dspec {m}"] = lambda ps, m=m: run_dspec(model, ps, args.tokens, method=m)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(str(model.name_or_path), dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(str(model.name_or_path))
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        engines["transformers"] = lambda ps: run_hf(hf, tok, ps, args.tokens)
    llama_note = None
    if not args.no_llama:
        try:
            from llama_cpp import Llama

            llm = Llama(model_path=str(smollm2_gguf_path()), n_threads=threads, n_ctx=2048, verbose=False, seed=0)
            engines["llama.cpp (Q4_1)"] = lambda ps: run_llama(llm, ps, args.tokens)
        except Exception as e:  # noqa: BLE001 - optional anchor
            llama_note = f"llama.cpp not run: {type(e).__name__}: {e}"
            print(llama_note)
    rows = []
    payload = {
        "bench": "ar",
        "dtype": str(dtype),
        "tokens": args.tokens,
        "env": env,
        "bandwidth": bw,
        "floor_ms_per_step": floor_ms,
        "weight_bytes": weight_bytes,
        "results": rows,
        "notes": [n for n in (llama_note,) if n],
    }
    path = out_dir(args, "cpu") / f"{args.name}.json"
    prompts_all = _prompts(max(batches))
    ar_tokens = {}
    for batch in batches:
        prompts = prompts_all[:batch]
        here = {
            engine: fn
            for engine, fn in engines.items()
            if not ((engine.startswith("llama") or engine.startswith("dspec ")) and batch > 1)
        }
        for fn in here.values():
            fn(prompts[:1])  # warm-up
        # call c of every engine before call c + 1 of any: the VMs' memory bandwidth drifts
        # within a minute, and the ratios compare engines at the same moments
        by_engine = {engine: [] for engine in here}
        for _ in range(args.calls):
            for engine, fn in here.items():
                by_engine[engine].append(fn(prompts))
        for engine, samples in by_engine.items():
            tps = [n / w for n, w, _ in samples]
            row = {
                "engine": engine,
                "batch": batch,
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "generated": samples[0][0],
                "loadavg": loadavg(),
            }
            if engine.startswith("dspec ") and ("dspec", batch) in ar_tokens:
                row["equal_to_ar"] = all(s[2] == ar_tokens[("dspec", batch)] for s in samples)
            if engine == "dspec":
                ar_tokens[("dspec", batch)] = samples[0][2]
                row["decode_step_ms"] = dspec_step_ms(model, prompts)
                row["decode_tokens_per_s"] = batch * 1e3 / row["decode_step_ms"]
            if batch == 1:
                row["ms_per_token"] = 1e3 / row["tokens_per_s"]
                row["fraction_of_floor"] = floor_ms / row["ms_per_token"]
            rows.append(row)
            print(
                f"batch {batch:3d} {engine:18s} {row['tokens_per_s']:7.1f} tok/s "
                f"[{row['tokens_per_s_min']:.1f}, {row['tokens_per_s_max']:.1f}]",
                flush=True,
            )
            write_json(path, payload)
    by = {(r["engine"], r["batch"]): r["tokens_per_s"] for r in rows}
    ratios = {}
    for batch in batches:
        if ("transformers", batch) in by:
            ratios[f"dspec/transformers batch {batch}"] = by[("dspec", batch)] / by[("transformers", batch)]
        for m in methods:
            if (f"dspec {m}", batch) in by:
                ratios[f"dspec {m}/ar batch {batch}"] = by[(f"dspec {m}", batch)] / by[("dspec", batch)]
                if ("llama.cpp (Q4_1)", batch) in by:
                    ratios[f"dspec {m}/llama.cpp batch {batch}"] = (
                        by[(f"dspec {m}", batch)] / by[("llama.cpp (Q4_1)", batch)]
                    )
        if ("llama.cpp (Q4_1)", batch) in by:
            ratios[f"dspec/llama.cpp batch {batch}"] = by[("dspec", batch)] / by[("llama.cpp (Q4_1)", batch)]
        if batch > 1:
            ratios[f"dspec batch {batch}/batch 1"] = by[("dspec", batch)] / by[("dspec", 1)]
            steps = {r["batch"]: r["decode_tokens_per_s"] for r in rows if r["engine"] == "dspec"}
            ratios[f"dspec decode steps batch {batch}/batch 1"] = steps[batch] / steps[1]
    payload["ratios"] = ratios
    payload["env"]["loadavg_end"] = loadavg()
    write_json(path, payload)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        names = list(dict.fromkeys(r["engine"] for r in rows))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            er = [r for r in rows if r["engine"] == name]
            xs = [batches.index(r["batch"]) + i * width for r in er]
            ax.bar(
                xs,
                [r["tokens_per_s"] for r in er],
                width,
                label=name,
                yerr=[
                    [r["tokens_per_s"] - r["tokens_per_s_min"] for r in er],
                    [r["tokens_per_s_max"] - r["tokens_per_s"] for r in er],
                ],
            )
        ax.axhline(1e3 / floor_ms, ls="--", color="k", lw=1, label="batch-1 weight-streaming floor")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))])
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens/s (all requests)")
        ax.set_title(
            f"SmolLM2-135M ar, {str(dtype).removeprefix('torch.')}, {env['cpu']['cpu_model']}, {threads} threads",
            fontsize=8,
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=90)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

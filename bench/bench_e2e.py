"""End-to-end decoding benchmark: ``dspec.generate`` on a fixed set of chat prompts.

    python bench/bench_e2e.py [--model smollm2-135m] [--methods ar,...] [--prompts 8]
                              [--max-new-tokens 64] [--batch 1] [--temperature 0] [--seed 0]
                              [--device cpu|cuda] [--quick] [--out DIR] [--no-plot]

For every method the prompts are decoded one at a time (``--batch 1``) or in batches of
``--batch`` prompts (one ``generate`` call per batch).  One untimed warm-up ``generate``
per method comes first.  Numbers are honest end-to-end numbers:

* tokens are *completion* tokens only (the prompt is excluded; up to and including EOS),
* wall time is the whole ``generate`` call (tokenisation, prefill and decode included),
* ``tokens_per_s`` = total new tokens / total wall time; the per-call distribution
  (median / p20 / p80) is over calls (a call = one prompt, or one batch when ``--batch`` > 1),
* NFE = model forwards per model (``target`` / ``drafter``), summed over calls,
* ``mean_accepted`` = the method's mean accepted tokens per target forward, averaged over
  calls weighted by new tokens.

Writes ``<out>/e2e.json`` (common's Recorder: env record + one row per call, rewritten after
each call, and one ``summary`` row per method) and ``<out>/e2e.png`` (tokens/s per method;
new tokens vs NFE).  Default ``<out>`` is ``bench/results/<device-slug>/``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402  (also puts the repo root on sys.path)

BENCH = "e2e"

# Short, varied chat prompts: code, facts, arithmetic, writing (in this order, repeated).
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of Australia?",
    "What is 17 multiplied by 23? Show your working.",
    "Write a two-sentence story about a lighthouse keeper.",
    "Write a SQL query that counts the orders per customer in a table named orders.",
    "Why is the sky blue? Answer briefly.",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
    "Write a short, polite email declining a meeting invitation.",
    "Explain what a Python list comprehension is, with one example.",
    "Name three planets of the solar system and one fact about each.",
    "What is 2 to the power of 10, minus 24?",
    "Write a haiku about autumn rain.",
]


def parse_args(argv=None):
    from dspec.decode.generate import METHODS

    default_dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="shipped model name or checkpoint directory (default: smollm2-135m)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated decoding methods (default: every one in METHODS, "
                        f"now {','.join(METHODS)}; those the model cannot run are skipped)")
    p.add_argument("--prompts", type=int, default=8,
                   help=f"number of built-in prompts (1..{len(PROMPTS)}, default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1,
                   help="1 = one prompt per generate call; >1 = batches of this many prompts")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_dev)
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default=None,
                   help="weight dtype (default: the checkpoint's)")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 new tokens (smoke test)")
    p.add_argument("--out", default=None,
                   help="output directory (default: bench/results/<device-slug>/)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 16
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.max_new_tokens < 1 or args.batch < 1:
        p.error("--max-new-tokens and --batch must be >= 1")
    args.methods_defaulted = args.methods is None
    args.methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown / unimplemented methods {unknown}; available: {sorted(METHODS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but torch.cuda.is_available() is False")
    return args


def _stats(vals: list[float]) -> dict:
    s = sorted(vals)
    return {"median": round(statistics.median(s), 3), "p20": round(common._percentile(s, 20), 3),
            "p80": round(common._percentile(s, 80), 3)}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def summarize(method: str, calls: list[dict], args) -> dict:
    new = sum(c["new_tokens"] for c in calls)
    wall = sum(c["wall_s"] for c in calls)
    nfe: dict[str, int] = {}
    for c in calls:
        for k, v in c["nfe"].items():
            nfe[k] = nfe.get(k, 0) + int(v)
    acc_w = sum(c["new_tokens"] for c in calls if c["mean_accepted"] is not None)
    mean_acc = (sum(c["mean_accepted"] * c["new_tokens"] for c in calls
                    if c["mean_accepted"] is not None) / acc_w) if acc_w else None
    tps = _stats([c["tokens_per_s"] for c in calls])
    return {
        "kind": "summary", "op": BENCH, "backend": method, "method": method, "case": "all",
        "dtype": calls[0]["dtype"], "prompts": args.prompts, "batch": args.batch,
        "calls": len(calls), "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "new_tokens": new, "wall_s": round(wall, 4),
        "tokens_per_s": round(new / wall, 3) if wall > 0 else None,
        "tokens_per_s_call_median": tps["median"], "tokens_per_s_call_p20": tps["p20"],
        "tokens_per_s_call_p80": tps["p80"],
        "nfe_target": nfe.get("target", 0), "nfe_drafter": nfe.get("drafter", 0), "nfe": nfe,
        "tokens_per_target_nfe": round(new / nfe["target"], 3) if nfe.get("target") else None,
        "mean_accepted": None if mean_acc is None else round(mean_acc, 3),
    }


def plot(payload: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = [r for r in payload["results"] if r.get("kind") == "summary"]
    calls = [r for r in payload["results"] if r.get("kind") == "call"]
    methods = [r["method"] for r in summ]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10.5, 4))
    xs = range(len(summ))
    a1.bar(xs, [r["tokens_per_s"] for r in summ], color="tab:blue", alpha=0.7, label="total")
    lo = [r["tokens_per_s_call_median"] - r["tokens_per_s_call_p20"] for r in summ]
    hi = [r["tokens_per_s_call_p80"] - r["tokens_per_s_call_median"] for r in summ]
    a1.errorbar(xs, [r["tokens_per_s_call_median"] for r in summ], yerr=[lo, hi], fmt="o",
                color="k", capsize=4, label="per-call median (p20-p80)")
    a1.set_xticks(list(xs))
    a1.set_xticklabels(methods)
    a1.set_ylabel("completion tokens / s")
    a1.set_title("throughput per method", fontsize=9)
    a1.grid(True, axis="y", alpha=0.3)
    a1.legend(fontsize=7)
    for m in methods:
        mc = [c for c in calls if c["method"] == m]
        a2.scatter([c["nfe_target"] + c["nfe_drafter"] for c in mc],
                   [c["new_tokens"] for c in mc], label=m, s=18)
    lim = max([c["nfe_target"] + c["nfe_drafter"] for c in calls] +
              [c["new_tokens"] for c in calls] + [1])
    a2.plot([0, lim], [0, lim], ls="--", color="gray", lw=1, label="1 token / forward")
    a2.set_xlabel("NFE per call (target + drafter)")
    a2.set_ylabel("completion tokens per call")
    a2.set_title("tokens vs NFE", fontsize=9)
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    env, cfg = payload["env"], payload["config"]
    fig.suptitle(f"e2e {cfg['model']} on {env['device_name']}, {cfg['prompts']} prompts x "
                 f"{cfg['max_new_tokens']} tok, batch {cfg['batch']}, T={cfg['temperature']} "
                 f"({env.get('date', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    import dspec
    from dspec.models.embedded import chat_prompt

    device = args.device
    torch.manual_seed(args.seed)
    dtype = common.DTYPES[args.dtype] if args.dtype else None
    print(f"device: {common.device_name(device)}; loading {args.model} ...", flush=True)
    t0 = time.perf_counter()
    model = dspec.load(args.model, device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    try:
        wdtype = common.DTYPE_NAMES.get(next(iter(model.parameters())).dtype, "?")
    except Exception:  # noqa: BLE001 - the model may not expose parameters()
        wdtype = args.dtype or "?"
    prompts = [chat_prompt(p) for p in PROMPTS[:args.prompts]]
    prompt_lens = [len(model.tokenizer.encode(p)) for p in prompts]
    # the Recorder wants a bandwidth record; a quick copy-bandwidth probe is cheap context
    bw = common.measure_bandwidth(device, quick=True)
    config = {"model": args.model, "methods": args.methods, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "batch": args.batch,
              "temperature": args.temperature, "seed": args.seed, "weight_dtype": wdtype,
              "load_s": round(load_s, 2), "prompt_tokens": prompt_lens,
              "prompt_texts": PROMPTS[:args.prompts], "warmup_calls_per_method": 1,
              "tokens": "completion only (prompt excluded), up to and including EOS",
              "wall": "whole generate() call incl. tokenisation and prefill"}
    rec = common.Recorder(BENCH, args, device, bw, config)
    rec.payload["skipped"] = {}
    rec.payload["env"]["loadavg_start"] = _loadavg()  # other load on the machine skews CPU numbers
    batches = [list(range(i, min(i + args.batch, len(prompts))))
               for i in range(0, len(prompts), args.batch)]
    summaries = []
    for method in args.methods:
        kw = dict(method=method, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature)
        try:  # warm-up: excluded from every number
            first = [prompts[i] for i in batches[0]]
            dspec.generate(model, first if args.batch > 1 else first[0], seed=args.seed, **kw)
            _sync(device)
        except ValueError as exc:
            if args.methods_defaulted:  # e.g. a diffusion method on an AR model: not an error
                rec.payload["skipped"][method] = str(exc)
                print(f"skipped {method}: {exc}", flush=True)
                continue
            rec.error(f"{method} warm-up: {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - one failing method must not stop the run
            rec.error(f"{method} warm-up: {type(exc).__name__}: {exc}")
            continue
        calls = []
        bar = tqdm(batches, desc=f"{method}", unit="call" if args.batch > 1 else "prompt")
        for ci, idx in enumerate(bar):
            batch = [prompts[i] for i in idx]
            try:
                _sync(device)
                t = time.perf_counter()
                gens = dspec.generate(model, batch if args.batch > 1 else batch[0],
                                      seed=args.seed + ci, **kw)
                _sync(device)
                wall = time.perf_counter() - t
            except Exception as exc:  # noqa: BLE001
                rec.error(f"{method} call {ci}: {type(exc).__name__}: {exc}")
                continue
            gens = gens if isinstance(gens, list) else [gens]
            st = gens[0].stats
            new = sum(len(g.tokens) for g in gens)
            row = {"kind": "call", "op": BENCH, "backend": method, "method": method,
                   "case": f"call{ci}", "dtype": wdtype, "prompt_ids": idx,
                   "prompt_tokens": [prompt_lens[i] for i in idx],
                   "new_tokens": new, "new_tokens_each": [len(g.tokens) for g in gens],
                   "wall_s": round(wall, 4), "gen_wall_s": round(st["wall_s"], 4),
                   "tokens_per_s": round(new / wall, 3),
                   "nfe": dict(st.get("nfe", {})),
                   "nfe_target": int(st.get("nfe", {}).get("target", 0)),
                   "nfe_drafter": int(st.get("nfe", {}).get("drafter", 0)),
                   "mean_accepted": st.get("mean_accepted"),
                   "texts": [g.text for g in gens]}
            calls.append(row)
            rec.add([row])
            bar.set_postfix(tok_s=f"{row['tokens_per_s']:.1f}")
        bar.close()
        if calls:
            s = summarize(method, calls, args)
            summaries.append(s)
            rec.add([s])

    rec.payload["env"]["loadavg_end"] = _loadavg()
    rec.finish(no_plot=True)
    if not args.no_plot and summaries:
        try:
            png = rec.dir / f"{BENCH}.png"
            plot(rec.payload, png)
            print(f"wrote {png}")
        except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the JSON
            print(f"plot failed: {exc!r}", file=sys.stderr)

    env = rec.payload["env"]
    print(f"\n{args.model} ({wdtype}) on {env['device_name']} [{device}, "
          f"{env['cpu_threads']} threads, torch {env['torch']}, git {str(env['git_commit'])[:10]}"
          f"{' dirty' if env['git_dirty'] else ''}]")
    print(f"{args.prompts} prompts x <= {args.max_new_tokens} new tokens, batch {args.batch}, "
          f"T={args.temperature}, seed {args.seed}; 1 warm-up call per method excluded; "
          f"completion tokens only; loadavg start {env.get('loadavg_start')} end "
          f"{env.get('loadavg_end')}")
    for m, why in rec.payload["skipped"].items():
        print(f"skipped {m}: {why}")
    cols = ["method", "calls", "new_tokens", "wall_s", "tokens_per_s", "tokens_per_s_call_median",
            "tokens_per_s_call_p20", "tokens_per_s_call_p80", "nfe_target", "nfe_drafter",
            "tokens_per_target_nfe", "mean_accepted"]
    if summaries:
        print(common.fmt_table(summaries, cols))
    return 1 if rec.payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

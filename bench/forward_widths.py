"""In-situ forward cost by suffix width: what one method's forwards cost inside real decoding.

A microbenchmark of one forward shape misses what a decode loop sees (the cache's layout,
the weights' residency between forwards, the adapter's [MASK] rows), so this times every
forward of ``dspec.generate`` itself: the method runs under each option set on the e2e
grid's prompts (greedy, batch 1, option sets interleaved per prompt), and every model
forward is timed and filed under its suffix width (tokens per row).  Rows: per option set
and width, the forwards, their median / p10 / p90 milliseconds and the mean [MASK] rows;
per option set, tokens, forwards and wall seconds.  The PNG plots the median against the
width, one line per option set -- where a row count crosses a tile boundary, it shows.

    python bench/forward_widths.py --model smollm2-135m-bd --method s2d2 \\
        --options '{"boundary": false}' '{"boundary": true}' --prompts 4 --name widths_s2d2_2026-11-29
Writes bench/results/cpu/<name>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import add_run_arguments, grid_texts, option_sets
from common import environment, write_json


class _Timed:
    """The model, timing each forward under the current label."""

    def __init__(self, model):
        self.inner, self.label = model, None
        self.times = defaultdict(list)  # (label, width) -> [(ms, mask rows)]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, plan, **kw):
        t0 = time.perf_counter()
        out = self.inner(plan, **kw)
        ms = (time.perf_counter() - t0) * 1e3
        masks = int((plan.tokens == self.inner.mask_token_id).sum()) if self.inner.mask_token_id is not None else 0
        self.times[(self.label, int(plan.tokens.shape[1]))].append((ms, masks))
        return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-bd", help="shipped name or checkpoint directory")
    ap.add_argument("--method", required=True)
    ap.add_argument("--options", nargs="+", required=True, metavar="JSON", help="option sets as JSON objects")
    add_run_arguments(ap, prompts=4, name=None)  # default name: widths_<method>
    args = ap.parse_args(argv)
    sets = option_sets(ap, "--options", args.options)
    torch.set_num_threads(args.threads)
    model = dspec.load(args.model)
    timed = _Timed(model)
    labels = [json.dumps(o, sort_keys=True) for o in sets]
    totals = {label: {"tokens": 0, "s": 0.0} for label in labels}
    for opts in sets:  # warm-up, untimed
        dspec.generate(model, "Hello", method=args.method, max_new_tokens=16, **opts)
    from tqdm.auto import tqdm

    texts = [t for ps in grid_texts(model, args.prompts).values() for t in ps]
    for text in tqdm(texts, desc="prompts"):
        for opts, label in zip(sets, labels):
            timed.label = label
            t0 = time.perf_counter()
            g = dspec.generate(timed, text, method=args.method, max_new_tokens=args.max_new_tokens, **opts)
            totals[label]["s"] += time.perf_counter() - t0
            totals[label]["tokens"] += len(g.tokens)
    rows = []
    for (label, width), samples in sorted(timed.times.items()):
        ms = sorted(s[0] for s in samples)
        q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
        rows.append(
            {
                "op": "forward",
                "backend": label,
                "case": f"width {width}",
                "width": width,
                "forwards": len(ms),
                "median_ms": statistics.median(ms),
                "p10_ms": q[0],
                "p90_ms": q[-1],
                "mean_mask_rows": sum(s[1] for s in samples) / len(samples),
            }
        )
    for label, t in totals.items():
        t["forwards"] = sum(len(v) for (lab, _), v in timed.times.items() if lab == label)
        t["tokens_per_s"] = t["tokens"] / t["s"] if t["s"] else 0.0
        t["tokens_per_forward"] = t["tokens"] / t["forwards"] if t["forwards"] else 0.0
        print(f"{args.method}{label}: {t['tokens_per_s']:.1f} tok/s, {t['tokens_per_forward']:.3f} tokens / forward")
    for r in rows:
        if r["forwards"] >= 5:
            print(
                f"  {r['backend']:>28} width {r['width']:>3}: {r['forwards']:>5} forwards, "
                f"median {r['median_ms']:.2f} ms"
            )
    payload = {
        "bench": "forward_widths",
        "env": environment("cpu"),
        "config": vars(args),
        "totals": totals,
        "rows": rows,
    }
    path = Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name or 'widths_' + args.method}.json"
    write_json(path, payload)
    plot(payload, path.with_suffix(".png"))
    return payload


def plot(payload: dict, path: Path, least: int = 5) -> None:
    """Median forward milliseconds against the suffix width, one line per option set (widths
    with at least ``least`` forwards), p10-p90 as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label in dict.fromkeys(r["backend"] for r in payload["rows"]):
        rs = [r for r in payload["rows"] if r["backend"] == label and r["forwards"] >= least]
        med = [r["median_ms"] for r in rs]
        err = [[m - r["p10_ms"] for m, r in zip(med, rs)], [r["p90_ms"] - m for m, r in zip(med, rs)]]
        ax.errorbar([r["width"] for r in rs], med, yerr=err, marker="o", ms=4, capsize=3, label=label)
    ax.axvline(16.5, ls="--", color="k", lw=1, label="16-row AMX tile")
    ax.set_xlabel("suffix width (tokens per row)")
    ax.set_ylabel("forward, median ms (p10-p90)")
    cfg, env = payload["config"], payload["env"]
    ax.set_title(f"{cfg['method']} on {cfg['model']}: in-situ forwards ({env['device_name']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()

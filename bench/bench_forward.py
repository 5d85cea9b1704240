"""Model forward cost against the suffix size: what a verification forward of N tokens costs
relative to one decode step, dspec against transformers on the same weights.

For every (dtype, prefix P, suffix N): one forward of N new tokens (causal) after a cached
prefix of P tokens, the cache left unchanged between reps; the reps of every (N, engine) of
one (dtype, P) are interleaved round-robin, so their ratios come from the same minutes; the
weight-streaming floor (weights' bytes / the measured DRAM read bandwidth, same threads) is
measured in the same run.  Rows: ``dspec`` and ``transformers`` (LlamaForCausalLM on the same safetensors
checkpoint, a DynamicCache cropped back to P after each rep).

With ``--masks F`` (a model with a [MASK] token, such as ``smollm2-135m-bd``) each N also
runs with its last ceil(F N) suffix tokens [MASK] (engine ``dspec+masks``): what the mask
adapter's update adds to a forward of that many rows.

    python bench/bench_forward.py                       # SmolLM2-135M, fp32 and bf16
    python bench/bench_forward.py --quick --model tiny-ar
    python bench/bench_forward.py --model smollm2-135m-bd --dtypes bfloat16 --prefixes 256 \
        --suffixes 1,4,8,13,16,17,24,32 --masks 0.7 --no-hf --name forward_masks
    python bench/bench_forward.py --dtypes bfloat16 --prefixes 256 --suffixes 1,2,4,8,16 \
        --avx2-chunk-steps 16,128 --no-hf --name forward_avx2_chunks   # an AVX2 kernel knob A/B
Writes bench/results/cpu/forward.{json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, measure_bandwidth, out_dir, write_json

SUFFIX = (1, 2, 4, 8, 16, 32, 64)
PREFIX = (256, 2048)
SETTLE_S = 0.02
BURST = 3


def _summary(raw: list[float]) -> dict:
    s = sorted(raw)
    return {
        "median_ms": statistics.median(s),
        "p20_ms": s[len(s) // 5],
        "p80_ms": s[(4 * len(s)) // 5],
        "raw_ms": [round(x, 3) for x in raw],
    }


def _time_interleaved(runs: dict, reps: int, warmup: int) -> dict:
    """Times every fn of ``runs`` (key -> (fn, scope factory)) round-robin: rep r of each
    before rep r + 1 of any, so all of them see the same phases of a VM whose memory
    bandwidth drifts by tens of percent within minutes (the N / N=1 ratios are the result).
    A rep is a burst of ``BURST`` back-to-back calls after an untimed pause of ``SETTLE_S``,
    which lets the other side's OpenMP workers stop spinning (a dspec forward right after a
    transformers one measured up to 20 % slower without it on 2 cores); the burst's first
    call, which wakes the sleeping workers after the pause, is not kept, so each side is
    timed as a decode loop runs it, forward after forward."""
    raw = {key: [] for key in runs}
    for rep in range(warmup + reps):
        for key, (fn, scope) in runs.items():
            time.sleep(SETTLE_S)
            with scope():
                for call in range(BURST):
                    t0 = time.perf_counter()
                    fn()
                    dt = (time.perf_counter() - t0) * 1e3
                    if rep >= warmup and call:
                        raw[key].append(dt)
    return {key: _summary(v) for key, v in raw.items()}


def dspec_forward(model, prefix: int, n: int, gen: torch.Generator, masks: int = 0):
    ids = torch.randint(0, model.config.vocab_size, (1, prefix + n), generator=gen)
    if masks:
        ids[0, prefix + n - masks :] = model.mask_token_id
    cache = model.new_cache(1, capacity=prefix + n)
    out = model(model.plan(ids[:, :prefix], cache), logits=None)
    cache.append(out.suffix_kv)
    plan = model.plan(ids[:, prefix:], cache)

    def run():
        with torch.no_grad():
            return model(plan, logits="all")

    return run


def hf_forward(hf, prefix: int, n: int, gen: torch.Generator):
    from transformers import DynamicCache

    ids = torch.randint(0, hf.config.vocab_size, (1, prefix + n), generator=gen)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids[:, :prefix], past_key_values=cache, use_cache=True)
    suffix = ids[:, prefix:]

    def run():
        with torch.no_grad():
            out = hf(suffix, past_key_values=cache, use_cache=True)
        cache.crop(-n)  # this transformers takes the count to drop
        return out

    return run


def load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    return hf.eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefixes", default=",".join(map(str, PREFIX)))
    p.add_argument("--suffixes", default=",".join(map(str, SUFFIX)))
    p.add_argument("--threads", default=None, help="torch threads (default: dspec's auto policy)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument(
        "--masks",
        type=float,
        default=0.0,
        help="also time each N with its last ceil(F N) tokens [MASK] (engine dspec+masks)",
    )
    p.add_argument(
        "--avx2-chunk-steps",
        default=None,
        help="comma-separated k chunks (steps) of the AVX2 16-bit tiles: one dspec engine per value "
        "(dspec[chunk=S]), interleaved like the rest (linear_avx2_chunk_steps of dspec._C)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="forward")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if not 0.0 <= args.masks <= 1.0:
        p.error(f"--masks must be in [0, 1], got {args.masks}")
    engines = ("dspec", "dspec+masks", "transformers") if args.masks else ("dspec", "transformers")
    chunks = {}
    if args.avx2_chunk_steps:
        try:
            chunks = {f"dspec[chunk={int(c)}]": int(c) for c in args.avx2_chunk_steps.split(",")}
        except ValueError:
            p.error(f"--avx2-chunk-steps takes integers, got {args.avx2_chunk_steps!r}")
        if min(chunks.values()) < 1:
            p.error("--avx2-chunk-steps must be >= 1")
        engines = (*chunks, *engines[1:])

    def masks_of(n: int, engine: str) -> int:
        return math.ceil(args.masks * n) if engine == "dspec+masks" else 0

    @contextlib.contextmanager
    def dspec_scope(engine: str):
        # dspec's forwards as a decode loop runs them (dspec.generate's scope: torch's own ops
        # on one thread, so no OpenMP team spins beside the pool), at the engine's chunk if any
        with dspec.cpu.torch_ops_one_thread():
            if engine not in chunks:
                yield
                return
            ext = _backend.extension()
            old = ext.linear_avx2_chunk_steps(True, chunks[engine])
            try:
                yield
            finally:
                ext.linear_avx2_chunk_steps(True, old)

    import dspec
    from dspec import _backend
    from dspec.cpu import apply_threads

    apply_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    suffixes = [int(x) for x in args.suffixes.split(",")]
    reps, warmup = (3, 1) if args.quick else (args.reps, 3)
    if args.quick:
        prefixes, suffixes = prefixes[:1], [1, 16]
    env = environment("cpu")
    bw = measure_bandwidth("cpu", quick=args.quick)
    print(
        f"{env['cpu']['cpu_model']} {env['cpu']['cpu_flags']}; {torch.get_num_threads()} threads; "
        f"DRAM read {bw['read_GBs']:.1f} GB/s; load {env['cpu']['loadavg']}",
        flush=True,
    )
    rows = []
    payload = {"bench": "forward", "env": env, "bandwidth": bw, "results": rows}
    path = out_dir(args, "cpu") / f"{args.name}.json"
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        model = dspec.load(args.model, dtype=dtype)
        if args.masks and model.mask_token_id is None:
            p.error(f"--masks: {args.model} has no [MASK] token")
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        floor_ms = weight_bytes / (bw["read_GBs"] * 1e6)
        hf = None
        if not args.no_hf and model.name_or_path:
            try:
                hf = load_hf(str(model.name_or_path), dtype)
            except Exception as e:  # noqa: BLE001 - recorded, the dspec rows still run
                payload.setdefault("errors", []).append(f"transformers: {type(e).__name__}: {e}")
        for prefix in prefixes:
            base = {}
            runs = {}
            for n in suffixes:
                for engine in engines:
                    if engine == "transformers" and hf is None:
                        continue
                    run = (
                        hf_forward(hf, prefix, n, gen)
                        if engine == "transformers"
                        else dspec_forward(model, prefix, n, gen, masks_of(n, engine))
                    )
                    scope = (
                        contextlib.nullcontext
                        if engine == "transformers"
                        else (lambda engine=engine: dspec_scope(engine))
                    )
                    runs[(n, engine)] = (run, scope)
            timed = _time_interleaved(runs, reps, warmup)
            for n in suffixes:
                for engine in engines:
                    if (n, engine) not in timed:
                        continue
                    t = timed[(n, engine)]
                    # [MASK] rows against the mask-free forward of the smallest N
                    base.setdefault(engine.removesuffix("+masks"), t["median_ms"])
                    row = {
                        "engine": engine,
                        "dtype": str(dtype).removeprefix("torch."),
                        "prefix": prefix,
                        "n": n,
                        "masks": masks_of(n, engine),
                        **t,
                        "vs_n1": t["median_ms"] / base[engine.removesuffix("+masks")],
                        "floor_ms": floor_ms,
                        "vs_floor": t["median_ms"] / floor_ms,
                        "weight_bytes": weight_bytes,
                    }
                    rows.append(row)
                    print(
                        f"{engine:12s} {row['dtype']:8s} P={prefix:5d} N={n:3d} {t['median_ms']:8.2f} ms "
                        f"({row['vs_n1']:.2f}x N=1, {row['vs_floor']:.2f}x floor {floor_ms:.1f} ms)",
                        flush=True,
                    )
                    write_json(path, payload)
        del model, hf
    payload["env"]["loadavg_end"] = dspec.cpu.loadavg()
    write_json(path, payload)
    if not args.no_plot:
        plot(payload, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    panels = sorted({(r["dtype"], r["prefix"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (dtype, prefix) in zip(axes.flat, panels):
        sel = [r for r in rows if r["dtype"] == dtype and r["prefix"] == prefix]
        for engine in dict.fromkeys(r["engine"] for r in sel):
            er = [r for r in sel if r["engine"] == engine]
            ax.errorbar(
                [r["n"] for r in er],
                [r["median_ms"] for r in er],
                yerr=[[r["median_ms"] - r["p20_ms"] for r in er], [r["p80_ms"] - r["median_ms"] for r in er]],
                marker="o",
                ms=3,
                capsize=2,
                label=engine,
            )
        ax.axhline(sel[0]["floor_ms"], ls="--", color="k", lw=1, label="weight-streaming floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("suffix tokens N")
        ax.set_ylabel("forward ms (median, p20-p80)")
        ax.set_title(f"{dtype}, prefix {prefix}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    env = payload["env"]
    fig.suptitle(
        f"forward vs N: {env['cpu']['cpu_model']}, {env['cpu']['torch_threads']} threads, load {env['cpu']['loadavg']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""Sweep the Triton cascade-attention schedule on a GPU: tiles, warps, stages, prefix splits.

    python bench/tune_cascade_gpu.py --out tune_cascade.json [--jobs 12] [--budget 200] [--graph]
    TRITON_INTERPRET=1 python bench/tune_cascade_gpu.py --smoke --out /tmp/t.json   # CPU dry run

Why: the first H100 run (bench/results/gpu/h100-2026-11-26) measured the op's own choice at
46x the memory roofline for B1 P4096 N64 (16 splits, 280 us, where the fused schedule took
150 us) and the kernel's tiles were never tuned on a GPU.  This script measures every
schedule in one call so that the defaults and the split rule can be chosen from data.

Phase 1 compiles every configuration in ``--jobs`` worker processes: each runs its shard once
on the B1 P4096 input, whose integer / pointer specialisations equal every case's (same N,
heads, D; chunk a multiple of BLOCK_N), so Triton's disk cache then holds every binary.
Phase 2 times every (case, configuration) in this process with ``triton.testing.do_bench``
(L2 cleared before each rep, median), checks each output against the default schedule's
(bf16, atol 2e-2), writes the JSON after each case and prints, per case, the default's time
and split count, the best fused / split / overall configuration and the roofline time
(prefix K/V read once + q, k, v, out; measured copy bandwidth).  ``--budget`` seconds bound
the whole run: cases not reached are listed as such.  ``--graph`` times CUDA-graph replays
(``triton.testing.do_bench_cudagraph``) instead of eager calls: the kernels' own time, without
the ~20 us of host work per Triton launch that set the eager numbers of small cases (the first
sweep's B1 rows); an engine that captures its decode step sees these.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK_M = (64, 128)
BLOCK_N = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4)
SPLITS = (1, 2, 4, 8, 16, 32)
HEADS = (32, 8, 128)  # Hq, Hkv, D: the first bench's headline head config
CASES = (  # (B, prefix lengths, N): the bench's quick grid + decode-sized
    (1, [4096], 64),
    (1, [32768], 64),
    (64, [4096] * 64, 64),
    (64, [32768] * 64, 64),
    (8, [500, 32768, 4096, 1000, 16384, 2000, 8192, 24576], 64),
    (8, [4096] * 8, 64),
    (1, [512], 64),
)


def configs(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(block_m=16, block_n=16, num_warps=1, num_stages=1, num_splits=s) for s in (1, 2)]
    return [
        dict(block_m=m, block_n=n, num_warps=w, num_stages=st, num_splits=s)
        for m, n, w, st, s in itertools.product(BLOCK_M, BLOCK_N, WARPS, STAGES, SPLITS)
    ]


def case_name(b: int, lens: list[int], n: int) -> str:
    p = f"P{lens[0]}" if len(set(lens)) == 1 else f"Pragged{min(lens)}-{max(lens)}"
    return f"{HEADS[0]}/{HEADS[1]}/{HEADS[2]} B{b} {p} N{n}"


def make_inputs(b: int, lens: list[int], n: int, device: str, dtype, seed: int = 0) -> dict:
    import bench_cascade_attention as bca

    c = {"Hq": HEADS[0], "Hkv": HEADS[1], "D": HEADS[2], "B": b, "N": n, "lens": lens}
    return bca.make_inputs(c, dtype, device, seed)


def run(x: dict, cfg: dict | None):
    from dspec.kernels import cascade_attention as ca

    kw = cfg or {}
    return ca.cascade_attention_triton(
        x["q"], x["k"], x["v"], x["words"], x["pk"], x["pv"], x["indptr"], None, False, max_prefix_len=x["max_p"], **kw
    )


def _compile_shard(args) -> list[tuple[int, str | None]]:
    """Worker: run each configuration of the shard once (fills Triton's disk cache)."""
    shard, device, smoke = args
    torch.set_num_threads(1)
    b, lens, n = (1, [64], 16) if smoke else CASES[0]
    x = make_inputs(b, lens, n, device, torch.float32 if smoke else torch.bfloat16)
    out = []
    for i, cfg in shard:
        try:
            run(x, cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            out.append((i, None))
        except Exception as exc:  # noqa: BLE001 -- out of shared memory etc.: recorded
            out.append((i, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"))
    return out


def timer(device: str, graph: bool = False):
    if device == "cuda" and graph:
        from triton.testing import do_bench_cudagraph

        return lambda fn: do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3

    def t(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    return t


def copy_bandwidth(device: str) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.ones(1 << 28, device=device)
    dst = torch.empty_like(src)
    from triton.testing import do_bench

    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run")
    ap.add_argument("--smoke", action="store_true", help="tiny case, 2 configurations (CPU dry run)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernel time, no launch cost)")
    ap.add_argument("--cases", default="", help="comma-separated indexes into CASES (default: all)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfgs = configs(args.smoke)
    cases = [(1, [64], 16), (2, [40, 70], 16)] if args.smoke else list(CASES)
    if args.cases and not args.smoke:
        picked = [int(i) for i in args.cases.split(",")]
        if any(not 0 <= i < len(CASES) for i in picked):
            raise ValueError(f"--cases: indexes must lie in [0, {len(CASES)}), got {args.cases}")
        cases = [CASES[i] for i in picked]

    # phase 1: compile in parallel
    errors: dict[int, str] = {}
    shards = [[(i, c) for i, c in enumerate(cfgs) if i % args.jobs == j] for j in range(args.jobs)]
    shards = [(s, device, args.smoke) for s in shards if s]
    with mp.get_context("spawn").Pool(len(shards)) as pool:
        for res in pool.imap_unordered(_compile_shard, shards):
            errors.update({i: e for i, e in res if e})
    t_compile = time.perf_counter() - t_start
    print(f"compiled {len(cfgs)} configurations in {t_compile:.0f}s ({len(errors)} failed)", flush=True)

    import triton

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "heads": HEADS,
        "compile_s": round(t_compile, 1),
        "copy_gbs": copy_bandwidth(device),
        "timer": (
            "triton.testing.do_bench_cudagraph(rep=20, median): graph replays"
            if args.graph
            else "triton.testing.do_bench(warmup=5, rep=20, median), L2 cleared per rep"
        ),
        "failed_configs": {json.dumps(cfgs[i]): e for i, e in errors.items()},
    }
    measure = timer(device, args.graph)
    payload = {"meta": meta, "cases": [], "not_reached": []}
    for b, lens, n in cases:
        name = case_name(b, lens, n)
        if time.perf_counter() - t_start > args.budget:
            payload["not_reached"].append(name)
            continue
        x = make_inputs(b, lens, n, device, dtype)
        from dspec.kernels import cascade_attention as ca

        chosen = []
        orig = ca.choose_splits
        ca.choose_splits = lambda *a, **k: chosen.append(orig(*a, **k)) or chosen[-1]
        try:
            ref = run(x, None)
        finally:
            ca.choose_splits = orig
        default = {"splits": chosen[-1] if chosen else None, "median_us": measure(lambda: run(x, None))}
        itemsize = torch.finfo(dtype).bits // 8
        nbytes = (2 * x["total"] * HEADS[1] * HEADS[2] + b * n * (2 * HEADS[0] + 2 * HEADS[1]) * HEADS[2]) * itemsize
        rows = []
        for i, cfg in enumerate(cfgs):
            row = dict(cfg)
            if i in errors:
                row["error"] = errors[i]
            elif cfg["num_splits"] > 1 and cfg["num_splits"] * cfg["block_n"] > x["max_p"]:
                row["error"] = "skipped: more splits than prefix tiles"
            elif time.perf_counter() - t_start > args.budget:
                row["error"] = "skipped: budget"
            else:
                try:
                    got = run(x, cfg)
                    err = float((got.float() - ref.float()).abs().max())
                    row["max_abs_diff"] = err
                    row["median_us"] = measure(lambda cfg=cfg: run(x, cfg))
                    if not err <= 2e-2:
                        row["error"] = f"MISMATCH {err:.3g}"
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
        payload["cases"].append(
            {"name": name, "B": b, "lens": lens, "N": n, "roofline_bytes": nbytes, "default": default, "rows": rows}
        )
        good = [r for r in rows if "median_us" in r and "error" not in r]
        roof = nbytes / (meta["copy_gbs"] * 1e9) * 1e6 if device == "cuda" else float("nan")
        line = f"{name}: default {default['median_us']:.1f}us (splits {default['splits']}), roofline {roof:.1f}us"
        for label, sel in (
            ("fused", [r for r in good if r["num_splits"] == 1]),
            ("split", [r for r in good if r["num_splits"] > 1]),
            ("best", good),
        ):
            if sel:
                r = min(sel, key=lambda r: r["median_us"])
                line += (
                    f" | {label} {r['median_us']:.1f}us m{r['block_m']} n{r['block_n']} "
                    f"w{r['num_warps']} s{r['num_stages']} S{r['num_splits']}"
                )
        print(line, flush=True)
        Path(args.out).write_text(json.dumps(payload, indent=1))
        x = ref = None  # frees the tensors; not `del`: closures above read them
        if device == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"done in {time.perf_counter() - t_start:.0f}s; not reached: {payload['not_reached'] or 'none'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

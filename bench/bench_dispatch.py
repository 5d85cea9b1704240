"""Is every dispatch decision of dspec's CPU path right?  Each decode-path op and a whole
forward, as the model calls them, against torch, at every instruction-set level this CPU has.

For each level L of this CPU (generic, avx2, avx512, amx -- as far as the CPU goes) a child
process runs with dspec capped to L (``DSPEC_CPU_ISA=L``) and torch capped to the same
instructions (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), so an AVX2-only CPU is
measured on a bigger one.  In it, per op, the path dspec's dispatch picks (``dispatch``, as a
decode loop runs it: inside ``dspec.cpu.torch_ops_one_thread``) against the plain torch path
(``torch``, with torch's own threads), reps interleaved round-robin:

- ``dense``: SmolLM2-135M's projection shapes (q / k, gate / up, down, the tied LM head)
  at M = 1 / 4 / 16 / 64 rows, ``dspec.models.dense.dense`` vs ``F.linear``, the weight
  warm in cache; ``dense_streamed``: the same calls cycling through copies of the weight
  that overflow the last-level cache, so each call reads its weight from memory, as a
  forward's layers do;
- ``cascade_attention``: 9 / 3 heads of 64, 256 cached keys, N = 1 / 4 / 16 / 64 causal
  suffix rows, ``backend=None`` vs ``backend="torch"``; ``attention_vs_sdpa``: the same
  call vs ``F.scaled_dot_product_attention`` on the same keys (torch's fastest attention;
  the public call includes its Python wrapper and validation, which a forward's layer stack
  does not run); ``attention_words_vs_sdpa``: the call given packed mask words (engines'
  form: repeated, it runs a cached plan); ``attention_plan_vs_sdpa``: a
  ``CascadeAttentionPlan``'s ``run`` (what an engine calls per layer, everything validated
  once) against the same SDPA call;
- ``rms_norm`` / ``rope``: the model's layer ops with and without the fused kernels;
- ``token_stats`` / ``topk_tokens`` / ``verify_chain``: N logits rows of 49152;
- ``forward``: the whole SmolLM2-135M forward after 256 cached tokens, N = 1 / 4 / 16 / 64,
  dspec vs transformers on the same weights (``--no-forward`` skips it).

A row where dspec's choice is slower than torch's by more than the noise allowance (5 %)
is flagged ``SLOWER`` in the report and in the JSON; the process exits 1 if any is.

    python bench/bench_dispatch.py                    # every level, fp32 and bf16
    python bench/bench_dispatch.py --levels avx2 --dtypes float32 --quick
Writes bench/results/cpu/dispatch.{json,png} (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LEVELS = ("generic", "avx2", "avx512", "amx")
# torch's own caps for a dspec level: ATen's vector code and oneDNN's ISA
TORCH_CAPS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}
ALLOWANCE = 1.05
# A rep is a burst of back-to-back calls spanning at least BURST_S (at least BURST_MIN
# calls) after an untimed pause of SETTLE_S; only its second half is kept.  Measured on a
# 2-core VM: after one 2-thread F.linear torch's OpenMP worker spins ~7 ms (its CPU time in
# /proc), and after a pause a sleeping worker (dspec's pool or OpenMP's) joins the first
# calls late; either halves a 2-thread 0.3 ms projection.  A burst's second half is each
# side's steady state, as a decode loop runs it.
SETTLE_S = 0.02
BURST_S = 0.008
BURST_MIN = 4
BURST_MAX = 64
SHAPES = (("q_proj", 576, 576), ("gate_proj", 1536, 576), ("down_proj", 576, 1536), ("lm_head", 49152, 576))
ROWS = (1, 4, 16, 64)
VOCAB = 49152
# weight bytes the streamed projection rows cycle through (over any 2-core VM's last-level
# cache; the LM head, larger, streams from one copy)
STREAM_BYTES = 96 << 20


def _interleaved(runs: dict, reps: int, warmup: int) -> dict:
    """key -> (fn, scope factory); rep r of every fn before rep r + 1 of any (a VM's
    bandwidth drifts).  A rep is a burst inside the fn's scope (entered and left outside
    the timer) after a pause of ``SETTLE_S``, long enough (``BURST_S``) that its second
    half, the half kept, runs free of the other side's spinning threads and of the cores'
    wake-up after the pause."""
    bursts = {}
    for key, (fn, scope) in runs.items():
        with scope():
            for _ in range(warmup):
                fn()
            t0 = time.perf_counter()
            fn()
            once = time.perf_counter() - t0
        bursts[key] = min(BURST_MAX, max(BURST_MIN, math.ceil(BURST_S / max(once, 1e-6))))
    raw = {key: [] for key in runs}
    for _ in range(reps):
        for key, (fn, scope) in runs.items():
            time.sleep(SETTLE_S)
            n = bursts[key]
            with scope():
                for call in range(n):
                    t0 = time.perf_counter()
                    fn()
                    if call >= n // 2:
                        raw[key].append((time.perf_counter() - t0) * 1e3)
    return {key: statistics.median(v) for key, v in raw.items()}


def _pair(rows: list, op: str, case: str, dtype, dispatch_fn, torch_fn, reps: int, warmup: int, extra=None):
    """dspec's choice (``dispatch_fn``) as a decode loop runs it -- inside
    ``dspec.cpu.torch_ops_one_thread``, dspec's kernels on its pool -- against the torch
    path (``torch_fn``) with torch's own threads, as a torch user runs it."""
    import dspec

    t = _interleaved(
        {"dispatch": (dispatch_fn, dspec.cpu.torch_ops_one_thread), "torch": (torch_fn, contextlib.nullcontext)},
        reps,
        warmup,
    )
    ratio = t["dispatch"] / t["torch"]
    row = {
        "op": op,
        "case": case,
        "dtype": str(dtype).removeprefix("torch."),
        "dispatch_ms": t["dispatch"],
        "torch_ms": t["torch"],
        "dispatch_over_torch": ratio,
        "slower": ratio > ALLOWANCE,
        **(extra or {}),
    }
    rows.append(row)
    print(
        f"  {op:18s} {case:24s} {row['dtype']:8s} dspec {t['dispatch']:9.3f} ms  torch {t['torch']:9.3f} ms  "
        f"{ratio:5.2f}x{'  SLOWER' if row['slower'] else ''}",
        flush=True,
    )


def child(args) -> dict:
    import torch
    import torch.nn.functional as F

    import dspec
    from common import environment
    from dspec import _backend
    from dspec.models import dense as dense_mod
    from dspec.models.layers import rotate
    from dspec.models.transformer import RMSNorm

    dspec.cpu.apply_threads(args.threads)
    torch.manual_seed(0)
    reps, warmup = (5, 2) if args.quick else (args.reps, 3)
    rows_list = (1, 16) if args.quick else ROWS
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    ext = _backend.extension()
    out = {"level": ext.cpu_isa(), "env": environment("cpu"), "rows": []}
    rows = out["rows"]
    print(
        f"level {ext.cpu_isa()} (linear fp32 {ext.linear_isa(0)}, bf16 {ext.linear_isa(2)}; attention "
        f"{ext.cascade_attention_isa()}); torch {torch.backends.cpu.get_cpu_capability()}; "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    for dtype in dtypes:
        for name, n, k in SHAPES[:2] if args.quick else SHAPES:
            w = (torch.randn(n, k) / k**0.5).to(dtype)
            # copies enough to overflow the last-level cache, called in turn: each call reads
            # its weight from memory, as a forward's layers do
            copies = [w] + [w.clone() for _ in range(max(0, math.ceil(STREAM_BYTES / w.nbytes) - 1))]
            for m in rows_list:
                x = torch.randn(m, k).to(dtype)
                for c in copies:
                    dense_mod.dense(x, c)  # packs once, outside the timing
                extra = {"packed": dense_mod.packed_path(x, w), "linear_isa": dense_mod.linear_isa(dtype)}
                _pair(
                    rows,
                    "dense",
                    f"{name} M={m}",
                    dtype,
                    lambda: dense_mod.dense(x, w),
                    lambda: F.linear(x, w),
                    reps,
                    warmup,
                    extra,
                )
                if len(copies) > 1:
                    turn = {"dispatch": 0, "torch": 0}

                    def streamed(side, fn, pool=copies):
                        def call():
                            turn[side] += 1
                            return fn(x, pool[turn[side] % len(pool)])

                        return call

                    _pair(
                        rows,
                        "dense_streamed",
                        f"{name} M={m}",
                        dtype,
                        streamed("dispatch", dense_mod.dense),
                        streamed("torch", F.linear),
                        reps,
                        warmup,
                        {**extra, "copies": len(copies)},
                    )
        hq, hkv, d, prefix = 9, 3, 64, 256
        pk, pv = torch.randn(prefix, hkv, d).to(dtype), torch.randn(prefix, hkv, d).to(dtype)
        indptr = torch.tensor([0, prefix], dtype=torch.int32)
        for n in rows_list:
            q = torch.randn(1, n, hq, d).to(dtype)
            kk, vv = torch.randn(1, n, hkv, d).to(dtype), torch.randn(1, n, hkv, d).to(dtype)
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
            kw = dict(prefix_k=pk, prefix_v=pv, prefix_indptr=indptr)
            _pair(
                rows,
                "cascade_attention",
                f"N={n} prefix={prefix}",
                dtype,
                lambda: dspec.cascade_attention(q, kk, vv, mask, **kw),
                lambda: dspec.cascade_attention(q, kk, vv, mask, backend="torch", **kw),
                reps,
                warmup,
            )
            # the same attention against torch's fastest: SDPA over the prefix's and the
            # suffix's keys with the equivalent boolean mask (GQA by enable_gqa)
            sq = q.transpose(1, 2)
            sk = torch.cat([pk[None], kk], 1).transpose(1, 2)
            sv = torch.cat([pv[None], vv], 1).transpose(1, 2)
            smask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), mask[0]], 1)
            # against SDPA: the one-shot call (validating and packing its dense mask), the
            # same call given packed mask words as engines keep them (repeated, it runs a
            # cached plan), and a plan's run (what an engine calls per layer)
            words = dspec.pack_mask(mask)
            plan = dspec.ops.CascadeAttentionPlan(1, n, hq, hkv, d, dtype, "cpu", mask, prefix_indptr=indptr)
            for op, mine in (
                ("attention_vs_sdpa", lambda: dspec.cascade_attention(q, kk, vv, mask, **kw)),
                ("attention_words_vs_sdpa", lambda: dspec.cascade_attention(q, kk, vv, words, **kw)),
                ("attention_plan_vs_sdpa", lambda: plan.run(q, kk, vv, pk, pv)),
            ):
                _pair(
                    rows,
                    op,
                    f"N={n} prefix={prefix}",
                    dtype,
                    mine,
                    lambda: F.scaled_dot_product_attention(sq, sk, sv, attn_mask=smask, enable_gqa=True),
                    reps,
                    warmup,
                )
            norm = RMSNorm(576, 1e-5).to(dtype)
            h = torch.randn(1, n, 576).to(dtype)
            with torch.no_grad():
                _pair(
                    rows,
                    "rms_norm",
                    f"N={n} hidden=576",
                    dtype,
                    lambda: norm(h),
                    lambda: norm(h, fused=False),
                    reps,
                    warmup,
                )
            cos, sin = torch.randn(1, n, 1, d), torch.randn(1, n, 1, d)
            qr, kr = torch.randn(1, n, hq, d).to(dtype), torch.randn(1, n, hkv, d).to(dtype)

            def fused_rope():
                a, b = qr.clone(), kr.clone()
                ext.rope(
                    a.data_ptr(),
                    b.data_ptr(),
                    cos.data_ptr(),
                    sin.data_ptr(),
                    _backend.FLOAT_CODE[dtype],
                    n,
                    hq,
                    hkv,
                    d,
                    dspec.cpu.kernel_threads(),
                )
                return a, b

            _pair(
                rows,
                "rope",
                f"N={n} heads={hq}+{hkv}",
                dtype,
                fused_rope,
                lambda: (rotate(qr.clone(), cos, sin), rotate(kr.clone(), cos, sin)),
                reps,
                warmup,
            )
            logits = torch.randn(n, VOCAB).to(dtype) * 4
            _pair(
                rows,
                "token_stats",
                f"N={n} V={VOCAB}",
                dtype,
                lambda: dspec.token_stats(logits),
                lambda: dspec.token_stats(logits, backend="torch"),
                reps,
                warmup,
            )
            _pair(
                rows,
                "topk_tokens",
                f"N={n} V={VOCAB} k=8",
                dtype,
                lambda: dspec.topk_tokens(logits, 8),
                lambda: dspec.topk_tokens(logits, 8, backend="torch"),
                reps,
                warmup,
            )
            drafts = torch.randint(0, VOCAB, (1, max(n - 1, 1)))
            tl = torch.randn(1, drafts.shape[1] + 1, VOCAB).to(dtype) * 4
            _pair(
                rows,
                "verify_chain",
                f"N={drafts.shape[1]} greedy",
                dtype,
                lambda: dspec.verify_chain(drafts, tl),
                lambda: dspec.verify_chain(drafts, tl, backend="torch"),
                reps,
                warmup,
            )
    if not args.no_forward:
        from bench_forward import dspec_forward, hf_forward, load_hf

        gen = torch.Generator().manual_seed(0)
        for dtype in dtypes:
            model = dspec.load("smollm2-135m", dtype=dtype)
            hf = load_hf(str(model.name_or_path), dtype)
            for n in rows_list:
                mine, theirs = dspec_forward(model, 256, n, gen), hf_forward(hf, 256, n, gen)
                _pair(
                    rows,
                    "forward",
                    f"N={n} prefix=256",
                    dtype,
                    mine,
                    theirs,
                    max(3, reps // 2),
                    2,
                    {"versus": "transformers"},
                )
            del model, hf
    return out


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in payload["levels"] if lv.get("rows")]
    fig, axes = plt.subplots(len(levels), 1, figsize=(12, 3.2 * len(levels)), squeeze=False)
    for ax, lv in zip(axes[:, 0], levels):
        rows = lv["rows"]
        labels = [f"{r['op']} {r['case']} {r['dtype']}" for r in rows]
        ratios = [r["dispatch_over_torch"] for r in rows]
        colors = ["tab:red" if r["slower"] else "tab:green" for r in rows]
        ax.bar(range(len(rows)), ratios, color=colors)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(ALLOWANCE, color="tab:red", lw=0.6, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("dspec / torch time")
        ax.set_title(f"level {lv['level']}: {sum(r['slower'] for r in rows)} of {len(rows)} slower than torch")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=90, fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default=None, help="comma-separated levels (default: every level of this CPU)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default=None, help="torch threads (default: dspec's auto policy)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-forward", action="store_true", help="skip the whole-forward rows")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="dispatch")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("CHILD-RESULT " + json.dumps(child(args)), flush=True)
        return 0
    from common import write_json
    from dspec import _backend

    ext = _backend.extension()
    if ext is None:
        raise SystemExit("bench_dispatch measures dspec._C: build it first")
    top = LEVELS.index(ext.cpu_isa_of_cpu())
    levels = args.levels.split(",") if args.levels else list(LEVELS[: top + 1])
    for lv in levels:
        if lv not in LEVELS or LEVELS.index(lv) > top:
            p.error(f"--levels: {lv!r} is not a level of this CPU ({', '.join(LEVELS[: top + 1])})")
    out = Path(args.out) if args.out else HERE / "results" / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    payload = {"bench": "dispatch", "allowance": ALLOWANCE, "levels": []}
    for lv in levels:
        env = dict(os.environ, DSPEC_CPU_ISA=lv, **TORCH_CAPS[lv])
        cmd = [sys.executable, __file__, "--child", "--dtypes", args.dtypes, "--reps", str(args.reps)]
        cmd += (["--threads", args.threads] if args.threads else []) + (["--quick"] if args.quick else [])
        cmd += ["--no-forward"] if args.no_forward else []
        print(f"== level {lv}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("CHILD-RESULT "):
                result = json.loads(line[len("CHILD-RESULT ") :])
            else:
                print(line, flush=True)
        if result is None:
            print(proc.stderr[-4000:], file=sys.stderr)
            result = {"level": lv, "error": proc.stderr[-4000:], "rows": []}
        result["torch_caps"] = TORCH_CAPS[lv]
        payload["levels"].append(result)
        write_json(path, payload)
    slower = [
        (lv["level"], r["op"], r["case"], r["dtype"]) for lv in payload["levels"] for r in lv["rows"] if r["slower"]
    ]
    payload["slower"] = slower
    write_json(path, payload)
    if not args.no_plot:
        plot(payload, path.with_suffix(".png"))
    print(f"{len(slower)} decision(s) slower than torch" + ("".join(f"\n  SLOWER {s}" for s in slower)))
    print(f"wrote {path}")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())

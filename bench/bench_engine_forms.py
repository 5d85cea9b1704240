"""The engine forms of the kernels against their uniform forms, on the CPU (or a GPU).

Rows (median and spread of interleaved reps, one process, ratios in one run):

- ``verify_chain`` B = 8, L = 7, V = 49152 (SmolLM2's vocabulary), T = 1 with draft_probs:
  the scalar temperature (the uniform fast path), a float32 ``temperature`` tensor [B] of
  equal values, the same with ``top_k`` / ``top_p`` per row, a mixed greedy / sampled batch,
  and a list of B generators;
- ``cascade_attention`` 9 query / 3 KV heads of 64, a 256-token ragged prefix per request:
  B = 8 requests of 8 suffix rows as the batched form, the same as the ragged form
  (``suffix_indptr``), and a ragged batch of 1..15 rows (the same 64 rows in all).

    python bench/bench_engine_forms.py --threads 2
Writes bench/results/<device>/engine_forms.json (``--out`` / ``--name`` to change it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import dspec
from dspec import cpu


def _time(fns: dict, reps: int, warmup: int = 3) -> dict:
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():  # interleaved round-robin
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for k, v in times.items()}


def verify_rows(device, reps):
    g = torch.Generator().manual_seed(0)
    b, length, vocab = 8, 7, 49152
    logits = (torch.randn(b, length + 1, vocab, generator=g) * 3).to(device)
    q = torch.softmax(torch.randn(b, length, vocab, generator=g) * 3, -1).to(device)
    drafts = torch.multinomial(q.reshape(-1, vocab).cpu(), 1, generator=g).view(b, length).to(device)
    coins = torch.rand(b, length, generator=g).to(device)
    uniforms = torch.rand(b, generator=g).to(device)
    temps = torch.ones(b, device=device)
    mixed = torch.tensor([0.0, 1.0] * (b // 2), device=device)
    top_k = torch.full((b,), 50, dtype=torch.int64, device=device)
    top_p = torch.full((b,), 0.9, device=device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(b)]
    common = {"draft_probs": q}
    fns = {
        "scalar temperature": lambda: dspec.verify_chain(
            drafts, logits, temperature=1.0, coins=coins, sample_uniforms=uniforms, **common
        ),
        "temperature [B]": lambda: dspec.verify_chain(
            drafts, logits, temperature=temps, coins=coins, sample_uniforms=uniforms, **common
        ),
        "temperature [B] + top_k + top_p": lambda: dspec.verify_chain(
            drafts, logits, temperature=temps, top_k=top_k, top_p=top_p, coins=coins, sample_uniforms=uniforms, **common
        ),
        "mixed greedy / sampled": lambda: dspec.verify_chain(
            drafts, logits, temperature=mixed, coins=coins, sample_uniforms=uniforms, **common
        ),
        "B generators": lambda: dspec.verify_chain(drafts, logits, temperature=1.0, generator=gens, **common),
    }
    return _time(fns, reps)


def attention_rows(device, reps, dtype):
    g = torch.Generator().manual_seed(1)
    b, n, hq, hkv, d, prefix = 8, 8, 9, 3, 64, 256
    total = b * n
    pk = torch.randn(b * prefix, hkv, d, generator=g).to(device, dtype)
    pv = torch.randn(b * prefix, hkv, d, generator=g).to(device, dtype)
    indptr = torch.arange(0, (b + 1) * prefix, prefix, dtype=torch.int32, device=device)
    q = torch.randn(b, n, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, n, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, n, hkv, d, generator=g).to(device, dtype)
    causal = dspec.masks.causal(n, device=device).words
    uniform_mask = causal.expand(b, n, -1).contiguous()
    even = torch.arange(0, total + 1, n, dtype=torch.int32, device=device)
    flat_mask = uniform_mask.reshape(total, -1)
    lengths = [1, 15, 3, 13, 5, 11, 7, 9]
    ragged = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    rows = [dspec.masks.causal(m, device=device).words for m in lengths]
    width = max(r.shape[-1] for r in rows)
    ragged_mask = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[-1])) for r in rows], 0)
    pre = {"prefix_k": pk, "prefix_v": pv, "prefix_indptr": indptr}
    fns = {
        "batched [B, N]": lambda: dspec.cascade_attention(q, k, v, uniform_mask, **pre),
        "ragged, equal lengths": lambda: dspec.cascade_attention(
            q.reshape(total, hq, d),
            k.reshape(total, hkv, d),
            v.reshape(total, hkv, d),
            flat_mask,
            suffix_indptr=even,
            **pre,
        ),
        "ragged, 1..15 rows": lambda: dspec.cascade_attention(
            q.reshape(total, hq, d),
            k.reshape(total, hkv, d),
            v.reshape(total, hkv, d),
            ragged_mask,
            suffix_indptr=ragged,
            **pre,
        ),
    }
    return _time(fns, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 reps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="engine_forms")
    args = ap.parse_args()
    reps = 3 if args.quick else args.reps
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    threads = cpu.default_threads() if args.threads == "auto" else int(args.threads)
    torch.set_num_threads(threads)
    os.environ["DSPEC_NUM_THREADS"] = str(threads)
    dspec.config.validate_values = False  # an engine's hot-loop setting
    with torch.no_grad():
        result = {
            "verify_chain": verify_rows(args.device, reps),
            "cascade_attention_bf16": attention_rows(args.device, reps, torch.bfloat16),
        }
    for group, rows in result.items():
        base = next(iter(rows.values()))["median_ms"]
        print(group)
        for name, r in rows.items():
            print(
                f"  {name:34s} {r['median_ms']:8.3f} ms  [{r['min_ms']:.3f}, {r['max_ms']:.3f}]  "
                f"{r['median_ms'] / base:5.2f}x the first row"
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
    ).stdout.strip()
    meta = {
        "command": " ".join(["python"] + sys.argv),
        "device": args.device,
        "threads": int(threads),
        "cpu": cpu.cpu_model() or platform.machine(),
        "loadavg": os.getloadavg(),
        "commit": commit,
        "torch": torch.__version__,
        "reps": reps,
    }
    out = Path(args.out or Path(__file__).resolve().parent / "results" / ("cpu" if args.device == "cpu" else "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": result}, indent=1) + "\n")
    print(f"wrote {out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark dspec.topk_tokens and dspec.mass_candidates against torch.topk + softmax.

Roofline bytes per case: ``rows * V * itemsize`` (one read of the logits) plus the outputs:
topk_tokens ``rows * k * 12`` (int64 id + float32 prob), mass_candidates
``rows * (max_m * 12 + 8)`` (ids, logprobs, int64 count).  Here k doubles as max_m.

Backends: torch (dspec reference: a full stable sort of V), chain (naive PyTorch: softmax
materialised, then torch.topk; for mass_candidates also cumsum + count + mask), triton on GPU.

    python bench/bench_topk.py --device cpu --quick
    python bench/bench_topk.py --device cuda --out /tmp/res
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tqdm import tqdm

import common

BENCH = "topk"
PROVIDED = ("torch", "triton")
TAU = 0.9


def chain_topk(logits: torch.Tensor, k: int):
    p = torch.softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(p, k, dim=-1)
    return ids, vals


def chain_mass(logits: torch.Tensor, tau: float, max_m: int):
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(logp, max_m, dim=-1)
    mass = torch.cumsum(vals.exp(), -1)
    count = torch.clamp((mass < tau).sum(-1) + 1, max=max_m)
    keep = torch.arange(max_m, device=logits.device) < count[..., None]
    return (torch.where(keep, ids, -1), torch.where(keep, vals, float("-inf")), count)


def cases(device: str, quick: bool) -> list[tuple[int, int, int, str]]:
    """(k, rows, V, dtype)."""
    if quick:
        if device == "cuda":
            return [(k, r, 151936, "bf16") for k in (1, 32) for r in (1, 256)]
        return [(k, r, 32000, "fp32") for k in (1, 8) for r in (1, 16)]
    if device == "cuda":
        # bf16 / 151936 first: the most relevant cases survive a timeout
        return [
            (k, r, v, d) for d in ("bf16", "fp32") for v in (151936, 32000) for k in (1, 8, 32) for r in (1, 16, 256)
        ]
    return [(k, r, v, d) for d in ("fp32", "bf16") for v in (32000, 151936) for k in (1, 8, 32) for r in (1, 16)]


def _check(op: str, name: str, got, ref) -> str:
    problems = []
    if name != common.ANCHOR:  # the anchor's torch.topk breaks ties arbitrarily
        bad = int((got[0] != ref[0]).sum())
        if bad:
            problems.append(f"tokens x{bad}")
    if op == "mass_candidates":
        bad = int((got[2] != ref[2]).sum())
        if bad:
            problems.append(f"count x{bad}")
        a, b = got[1].float(), ref[1].float()
        fin = torch.isfinite(a) & torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)) or not torch.allclose(
            a[fin], b[fin], rtol=2e-3, atol=2e-3
        ):
            problems.append("logprobs")
    else:
        if not torch.allclose(got[1].float(), ref[1].float(), rtol=2e-3, atol=1e-5, equal_nan=True):
            problems.append("probs")
    return "ok" if not problems else "MISMATCH " + ", ".join(problems)


def main(argv=None) -> int:
    args = common.base_parser(__doc__.splitlines()[0]).parse_args(argv)
    device, bw = common.setup(args)
    import dspec
    from dspec.reference import topk as ref

    wanted = common.parse_backends(args.backends)
    backends = common.select(["torch", common.ANCHOR] + common.available_backends(device, PROVIDED[1:]), wanted)
    reps, warmup = common.reps_for(args, device)
    flush = not args.no_flush
    all_cases = cases(device, args.quick)
    rec = common.Recorder(
        BENCH,
        args,
        device,
        bw,
        {
            "backends": backends,
            "reps": reps,
            "warmup": warmup,
            "flush_l2": flush,
            "temperature": 1.0,
            "tau": TAU,
            "logits": "randn * 4",
            "bytes": {
                "topk_tokens": "rows*V*itemsize + rows*k*12",
                "mass_candidates": "rows*V*itemsize + rows*(12*max_m + 8)",
            },
        },
    )
    print(f"backends: {backends}; {len(all_cases)} cases x 2 ops; reps={reps} warmup={warmup}")

    def fn_for(op, name, x, k):
        if op == "topk_tokens":
            if name == common.ANCHOR:
                return lambda: chain_topk(x, k)
            return lambda: dspec.topk_tokens(x, k, backend=name)
        if name == common.ANCHOR:
            return lambda: chain_mass(x, TAU, k)
        return lambda: dspec.mass_candidates(x, TAU, k, backend=name)

    for k, rows, vocab, dname in tqdm(all_cases, desc=BENCH, file=sys.stdout, mininterval=2):
        dtype = common.DTYPES[dname]
        case = f"k{k} {rows}x{vocab}"
        x = common.random_logits(rows, vocab, dtype, device, seed=args.seed)
        read = rows * vocab * x.element_size()
        out_rows = []
        for op, nbytes, reference in (
            ("topk_tokens", read + rows * k * 12, lambda: ref.topk_tokens(x, k)),
            ("mass_candidates", read + rows * (12 * k + 8), lambda: ref.mass_candidates(x, TAU, k)),
        ):
            expect = None if args.no_check else reference()
            for name in backends:
                fn = fn_for(op, name, x, k)
                try:
                    check = None if expect is None else _check(op, name, fn(), expect)
                    t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush)
                except Exception as exc:  # noqa: BLE001
                    rec.error(f"{op} {case} {dname} {name}: {type(exc).__name__}: {exc}")
                    continue
                out_rows.append(
                    common.make_row(
                        op=op,
                        backend=name,
                        case=case,
                        params={"k": k, "rows": rows, "V": vocab},
                        dtype=dname,
                        timing=t,
                        bytes_moved=nbytes,
                        copy_GBs=rec.copy_GBs,
                        check=check,
                    )
                )
        rec.add(out_rows)
        x = None  # frees the tensors; not `del`: closures above read them
        common.free_cuda(device)

    rec.finish(no_plot=args.no_plot)
    cols = [
        "op",
        "case",
        "dtype",
        "backend",
        "median_us",
        "GB_s",
        "pct_of_copy_bw",
        "speedup_vs_torch",
        "speedup_vs_chain",
        "check",
    ]
    print(common.fmt_table(rec.rows, cols))
    return 1 if rec.payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

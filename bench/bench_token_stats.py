"""Benchmark dspec.token_stats against the PyTorch chain and the dspec torch reference.

Roofline bytes per case: ``rows * V * itemsize`` (one read of the logits)
+ ``rows * 24`` (token int64 + prob, margin, entropy, lse float32).

Backends: torch (dspec reference), chain (naive PyTorch: softmax -> topk(2) -> entropy ->
logsumexp, separate kernels, softmax materialised), triton and cuda on GPU, cpp on CPU.
Headline: 1024 x 151936 bf16 on GPU, target >= 80 % of copy bandwidth and >= 3x the chain.

    python bench/bench_token_stats.py --device cpu --quick
    python bench/bench_token_stats.py --device cuda --out /tmp/res
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tqdm import tqdm

import common

BENCH = "token_stats"
PROVIDED = ("torch", "triton", "cuda", "cpp")
HEADLINE = (1024, 151936, "bf16")
OUT_BYTES_PER_ROW = 24


def chain(logits: torch.Tensor, temperature: float = 1.0):
    """The naive PyTorch way: every statistic its own kernel, softmax materialised."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    p = torch.softmax(x, dim=-1)
    top = torch.topk(p, 2, dim=-1)
    token = top.indices[..., 0]
    prob = top.values[..., 0]
    margin = top.values[..., 0] - top.values[..., 1]
    entropy = torch.special.entr(p).sum(-1)
    lse = torch.logsumexp(x, dim=-1)
    return token, prob, margin, entropy, lse


def cases(device: str, quick: bool) -> list[tuple[int, int, str]]:
    if device == "cuda":
        if quick:
            out = [(r, 151936, "bf16") for r in (1, 64, 1024)]
        else:
            out = [
                (r, v, d)
                for d in ("bf16", "fp16", "fp32")
                for v in (32000, 151936, 256000)
                for r in (1, 8, 64, 256, 1024)
            ]
    else:
        if quick:
            out = [(r, 32000, d) for d in ("fp32", "bf16") for r in (1, 8)]
        else:
            out = [(r, v, d) for d in ("fp32", "bf16") for v in (32000, 151936) for r in (1, 8, 64)]
    if HEADLINE in out:  # measured first, so a timed-out run still has it
        out.remove(HEADLINE)
        out.insert(0, HEADLINE)
    return out


def _check(name: str, got, ref) -> str:
    """Compare with the reference: exact argmax for dspec backends, close floats for all."""
    g_tok, *g_f = got
    r_tok, *r_f = ref
    problems = []
    if name != "chain":  # the chain's topk breaks ties arbitrarily
        bad = int((g_tok.reshape(-1) != r_tok.reshape(-1)).sum())
        if bad:
            problems.append(f"token x{bad}")
    fields = ("prob", "margin", "entropy", "lse") if name != "chain" else ("prob", "entropy", "lse")
    idx = {"prob": 0, "margin": 1, "entropy": 2, "lse": 3}
    for f in fields:
        a = g_f[idx[f]].float().reshape(-1)
        b = r_f[idx[f]].float().reshape(-1)
        if not torch.allclose(a, b, rtol=2e-3, atol=2e-3, equal_nan=True):
            problems.append(f"{f} max|d|={float((a - b).abs().nan_to_num().max()):.2e}")
    return "ok" if not problems else "MISMATCH " + ", ".join(problems)


def main(argv=None) -> int:
    args = common.base_parser(__doc__.splitlines()[0]).parse_args(argv)
    device, bw = common.setup(args)
    import dspec
    from dspec.reference import token_stats as ref_token_stats

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
            "logits": "randn * 4",
            "bytes": "rows*V*itemsize + rows*24",
        },
    )
    print(f"backends: {backends}; {len(all_cases)} cases; reps={reps} warmup={warmup}")

    def fn_for(name, x):
        if name == common.ANCHOR:
            return lambda: chain(x)
        return lambda: dspec.token_stats(x, backend=name)

    for rows, vocab, dname in tqdm(all_cases, desc=BENCH, file=sys.stdout, mininterval=2):
        dtype = common.DTYPES[dname]
        case = f"{rows}x{vocab}"
        try:
            x = common.random_logits(rows, vocab, dtype, device, seed=args.seed)
        except RuntimeError as exc:
            rec.error(f"{case} {dname}: input allocation failed: {exc}")
            continue
        nbytes = rows * vocab * x.element_size() + rows * OUT_BYTES_PER_ROW
        ref = None if args.no_check else ref_token_stats(x)
        out_rows = []
        for name in backends:
            fn = fn_for(name, x)
            try:
                check = None if ref is None else _check(name, fn(), ref)
                t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush)
            except Exception as exc:  # noqa: BLE001 - one failing backend must not stop the run
                rec.error(f"{case} {dname} {name}: {type(exc).__name__}: {exc}")
                continue
            out_rows.append(
                common.make_row(
                    op=BENCH,
                    backend=name,
                    case=case,
                    params={"rows": rows, "V": vocab},
                    dtype=dname,
                    timing=t,
                    bytes_moved=nbytes,
                    copy_GBs=rec.copy_GBs,
                    check=check,
                )
            )
        rec.add(out_rows)
        del x, ref
        common.free_cuda(device)

    rec.finish(no_plot=args.no_plot)
    cols = [
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
    print_headline(rec.rows, bw)
    return 1 if rec.payload["errors"] else 0


def print_headline(rows: list[dict], bw: dict) -> None:
    r0, v0, d0 = HEADLINE
    hits = [r for r in rows if r["rows"] == r0 and r["V"] == v0 and r["dtype"] == d0]
    if not hits:
        return
    print(
        f"\nHEADLINE token_stats {r0}x{v0} {d0}  (copy BW {bw['copy_GBs']:.0f} GB/s; "
        "targets: >= 80 % of copy BW, >= 3x the chain)"
    )
    for r in hits:
        if r["backend"] in ("torch", common.ANCHOR):
            print(f"  {r['backend']:>7}: {r['median_us']:9.1f} us  {r['GB_s']:7.1f} GB/s {r['pct_of_copy_bw']:5.1f} %")
            continue
        ok_bw = r["pct_of_copy_bw"] >= 80
        ok_sp = (r["speedup_vs_chain"] or 0) >= 3
        print(
            f"  {r['backend']:>7}: {r['median_us']:9.1f} us  {r['GB_s']:7.1f} GB/s "
            f"{r['pct_of_copy_bw']:5.1f} % [{'PASS' if ok_bw else 'FAIL'}]  "
            f"{r['speedup_vs_chain']}x vs chain [{'PASS' if ok_sp else 'FAIL'}]  check={r['check']}"
        )


if __name__ == "__main__":
    sys.exit(main())

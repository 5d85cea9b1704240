"""The logits-side ops on the CPU at the verification shape (B 64, L 16, V 49152: SmolLM2's
vocabulary): GB/s of logits read against the machine's DRAM read bandwidth measured in the
same run, cpp against the torch reference.  Verification reads a request's rows only up to
the one it stops at (the drafts follow the target's argmax for a random prefix): its GB/s
count those rows (``rows_read_fraction`` of the tensor).

    python bench/bench_logits_cpu.py [--threads N] [--reps 5]
Writes bench/results/cpu/logits_ops.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, measure_bandwidth, out_dir, time_fn, write_json


def cases(batch: int, length: int, vocab: int, dtype: torch.dtype):
    import dspec

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, length + 1, vocab, generator=g) * 3).to(dtype)
    # drafts: the target's argmax for a random prefix of each row, random ids after, so that
    # greedy verification accepts about half the chain (the rows past a rejection are never
    # read on the CPU: see rows_read)
    keep = torch.randint(0, length + 1, (batch,), generator=g)
    drafts = torch.where(
        torch.arange(length)[None, :] < keep[:, None],
        logits[:, :length].float().argmax(-1),
        torch.randint(0, vocab, (batch, length), generator=g),
    )
    coins, uni = torch.rand(batch, length, generator=g), torch.rand(batch, generator=g)
    parents = torch.tensor([-1] + list(range(length))).expand(batch, -1).contiguous()
    tree_tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts], 1)
    tcoins = torch.rand(batch, length + 1, generator=g)
    return {
        "token_stats": lambda b: dspec.token_stats(logits, backend=b),
        "verify_chain greedy": lambda b: dspec.verify_chain(drafts, logits, backend=b),
        "verify_chain T=1": lambda b: dspec.verify_chain(
            drafts, logits, temperature=1.0, coins=coins, sample_uniforms=uni, backend=b
        ),
        "verify_tree T=1": lambda b: dspec.verify_tree(
            tree_tokens, parents, logits, temperature=1.0, coins=tcoins, sample_uniforms=uni, backend=b
        ),
        "topk_tokens k=8": lambda b: dspec.topk_tokens(logits, 8, backend=b),
        "mass_candidates m=8": lambda b: dspec.mass_candidates(logits, 0.9, 8, backend=b),
    }, logits.numel() * logits.element_size()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--threads", default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference rows")
    p.add_argument(
        "--flush-mib",
        type=int,
        default=640,
        help="MiB rewritten before every rep (default 640: twice a 300 MiB L3 and more)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    import dspec
    from dspec.cpu import apply_threads, loadavg

    threads = apply_threads(args.threads)
    dspec.config.validate_values = False  # engine mode: no value checks
    env = environment("cpu")
    bw = measure_bandwidth("cpu")
    print(f"{env['cpu']['cpu_model']}; {threads} threads; DRAM read {bw['read_GBs']:.1f} GB/s", flush=True)
    rows = []
    payload = {
        "bench": "logits_ops",
        "shape": [args.batch, args.length + 1, args.vocab],
        "env": env,
        "bandwidth": bw,
        "results": rows,
    }
    path = out_dir(args, "cpu") / "logits_ops.json"
    backends = ["cpp"] + ([] if args.no_reference else ["torch"])
    # larger than the last-level cache (this project's Xeon has 300 MiB of L3, more than the
    # 214 MB of float32 logits): rewritten before every rep, so that every rep reads the
    # logits from memory as a decode step does (without the flush the reps read them from L3)
    flush_bytes = int(args.flush_mib) << 20
    payload["flush_bytes_between_reps"] = flush_bytes
    for dtype in (torch.float32, torch.bfloat16):
        ops, nbytes = cases(args.batch, args.length, args.vocab, dtype)
        for op, fn in ops.items():
            for backend in backends:
                reps = args.reps if backend == "cpp" else max(1, args.reps // 2)
                t = time_fn(lambda: fn(backend), "cpu", reps=reps, warmup=1, flush_bytes=flush_bytes)
                # the bytes the op must read: every row, except for verification, which reads a
                # request's rows up to the one it stops at (num_accepted + 1 of them)
                read = nbytes
                if op.startswith("verify"):
                    out = fn(backend)
                    read = nbytes * float((out.num_accepted + 1).sum()) / (args.batch * (args.length + 1))
                gbs = read / (t["median_us"] * 1e3)
                row = {
                    "op": op,
                    "dtype": str(dtype).removeprefix("torch."),
                    "backend": backend,
                    "median_ms": t["median_us"] / 1e3,
                    "p20_ms": t["p20_us"] / 1e3,
                    "p80_ms": t["p80_us"] / 1e3,
                    "GB_s": gbs,
                    "fraction_of_read_bw": gbs / bw["read_GBs"],
                    "bytes": nbytes,
                    "bytes_read": read,
                    "rows_read_fraction": read / nbytes,
                }
                rows.append(row)
                print(
                    f"{row['dtype']:8s} {op:22s} {backend:6s} {row['median_ms']:9.2f} ms {gbs:6.2f} GB/s "
                    f"({row['fraction_of_read_bw']:.0%} of read bandwidth; {read / nbytes:.0%} of the rows)",
                    flush=True,
                )
                write_json(path, payload)
    payload["env"]["loadavg_end"] = loadavg()
    write_json(path, payload)
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for ax, dtype in zip(axes, ("float32", "bfloat16")):
            sel = [r for r in rows if r["dtype"] == dtype]
            names = list(dict.fromkeys(r["op"] for r in sel))
            for i, backend in enumerate(backends):
                br = {r["op"]: r["GB_s"] for r in sel if r["backend"] == backend}
                ax.bar([j + 0.4 * i for j in range(len(names))], [br[n] for n in names], 0.4, label=backend)
            ax.axhline(bw["read_GBs"], ls="--", color="k", lw=1, label="DRAM read")
            ax.set_xticks([j + 0.2 for j in range(len(names))])
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("GB/s of logits rows read")
            ax.set_title(f"{dtype} [{args.batch}, {args.length + 1}, {args.vocab}], {threads} threads", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=90)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The small-row projection (dspec._C.linear on the packed weight, what ``dspec.models.dense``
runs for every row count it packs, ``PACKED_MAX_ROWS_BY_ISA``) against torch's F.linear (oneDNN) on SmolLM2-135M's
weight shapes.  The weight is packed once, outside the timing (a model packs it on its
first forward).

On a CPU with AMX-BF16 the bf16 rows run on the AMX tiles (``cpp``); ``cpp-avx512`` times the
AVX512_BF16 tiles of the same packed weight beside them.

Rows x = [M, K] for M = 1..128 (a decode step is M = batch, a verification forward M =
batch x suffix), weight [N, K] cold in cache (a 64 MiB buffer is written between reps, as a
decode step streams 270 MB of weights past the cache).  GB/s counts the weight's bytes: at
small M the op is a weight stream, so the read bandwidth measured in the same run is its
roofline.  Per op, F.linear catches up from ~128 rows; a whole forward stays faster on
the packed path (prefill of 65-2048 tokens), so ``dense.PACKED_MAX_ROWS_BY_ISA`` has no limit
where dspec has SIMD tiles.  ``DSPEC_CPU_ISA=avx2`` times the AVX2 tiles on a bigger CPU.

    python bench/bench_linear.py                 # bf16 and fp32
    python bench/bench_linear.py --quick
Writes bench/results/cpu/linear.{json,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPE_NAMES, DTYPES, Recorder, base_parser, make_row, reps_for, setup, time_fn

# (name, N, K) of SmolLM2-135M: q / o, k / v, gate / up, down, the tied LM head
SHAPES = (
    ("q_proj", 576, 576),
    ("k_proj", 192, 576),
    ("gate_proj", 1536, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()
    device, bw = setup(args)
    if device != "cpu":
        raise SystemExit("bench_linear measures the CPU kernel: --device cpu")
    from dspec import _backend
    from dspec.models.dense import packed_weight

    ext = _backend.extension()
    if ext is None or not hasattr(ext, "linear"):
        raise SystemExit("dspec._C with linear is not built")
    threads = torch.get_num_threads()
    reps, warmup = reps_for(args, device, default_cpu=30, quick=5)
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    rows_list = ROWS[:4] if args.quick else ROWS
    shapes = SHAPES[:2] if args.quick else SHAPES
    rec = Recorder(
        "linear",
        args,
        device,
        bw,
        {
            "shapes": shapes,
            "rows": rows_list,
            "threads": threads,
            "isa": {DTYPE_NAMES[d]: ext.linear_isa(_backend.FLOAT_CODE[d]) for d in dtypes},
        },
    )
    for dtype in dtypes:
        code = _backend.FLOAT_CODE[dtype]
        for name, n, k in shapes:
            w = (torch.randn(n, k) / k**0.5).to(dtype)
            packed = packed_weight(w)  # once per weight, as a model does
            for m in rows_list:
                x = torch.randn(m, k).to(dtype)
                out = torch.empty(m, n, dtype=dtype)

                def cpp(isa="auto"):
                    ext.linear(x.data_ptr(), packed.data_ptr(), 0, out.data_ptr(), code, m, k, n, k, n, threads, isa)

                cpp()
                ref = F.linear(x, w)
                err = (out.float() - ref.float()).abs().max().item()
                case = f"{name} M={m}"
                params = {"shape": name, "M": m, "N": n, "K": k}
                nbytes = w.numel() * w.element_size()
                new = []
                runs = [("cpp", cpp), ("torch", lambda: F.linear(x, w))]
                if ext.linear_isa(code) == "amx":  # the AVX512_BF16 tiles AMX replaces
                    runs.append(("cpp-avx512", lambda: cpp("avx512")))
                for backend, fn in runs:
                    t = time_fn(fn, device, reps=reps, warmup=warmup)
                    new.append(
                        make_row(
                            op="linear",
                            backend=backend,
                            case=case,
                            params=params,
                            dtype=DTYPE_NAMES[dtype],
                            timing=t,
                            bytes_moved=nbytes,
                            copy_GBs=bw["copy_GBs"],
                            extra={
                                "pct_of_read_bw": round(100 * nbytes / (t["median_us"] * 1e3) / bw["read_GBs"], 1),
                                "max_abs_diff_vs_torch": err,
                            },
                        )
                    )
                rec.add(new)
                c, f = new[:2]
                extra = "".join(f"  {r['backend']} {r['median_us']:9.1f} us" for r in new[2:])
                print(
                    f"{DTYPE_NAMES[dtype]} {case:20s} cpp {c['median_us']:9.1f} us ({c['GB_s']:6.1f} GB/s)  "
                    f"torch {f['median_us']:9.1f} us ({f['GB_s']:6.1f} GB/s)  x{c['speedup_vs_torch']}{extra}",
                    flush=True,
                )
    rec.finish({"panel_keys": ("shape", "dtype")}, no_plot=args.no_plot)


if __name__ == "__main__":
    main()

"""The mask adapter's update at a forward's [MASK] rows (``dspec._C.mask_lora``) on the CPU:
what a block-diffusion forward of ``smollm2-135m-bd`` pays beyond the base model's.

One timed call is one forward's worth: the rank-16 update of SmolLM2-135M's seven projections
(q, k, v, o, gate, up, down) in each of 30 layers, every layer its own adapter matrices (bf16,
as the shipped adapter holds them: 9.8 MB, past L2 as in a forward), at M [MASK] rows of bf16
activations.  Arms, interleaved round-robin per rep (this VM's speed drifts within minutes):
``cpp-amx`` (the tile-unit code on the adapter packed by ``mask_lora_pack``, where the CPU has
AMX-BF16: what a bf16 forward runs there), ``cpp`` (the AVX-512 code where the CPU has it),
``cpp-generic`` (the portable loops) and ``torch`` (MaskLoraLinear's per-op update:
index_select, two F.linear, index_add), at 1 and all threads.  Each timed call includes the
Python binding's ~1 us per projection (210 calls), which a forward's one-call stack does not
pay.  GFLOP/s counts 2 * M * rank * (k + n) per projection.

    python bench/bench_mask_lora.py [--rows 1,4,16,32] [--reps 30]
Writes bench/results/cpu/mask_lora.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, out_dir, write_json

# (k, n) of SmolLM2-135M's q, k, v, o, gate, up, down
SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
LAYERS, RANK, TOTAL_ROWS = 30, 16, 64


def _adapters(gen: torch.Generator):
    return [
        [
            (
                (torch.randn(RANK, k, generator=gen) / 24).bfloat16(),
                (torch.randn(RANK, n, generator=gen) / 4).bfloat16(),
            )
            for k, n in SHAPES
        ]
        for _ in range(LAYERS)
    ]


def _packed(adapters):
    """The adapters as mask_lora_pack lays them out for the AMX code (None without AMX-BF16):
    made once and shared by every row count, as the cpp arms share ``adapters``."""
    from dspec import _backend

    ext, b16 = _backend.extension(), _backend.FLOAT_CODE[torch.bfloat16]
    if not ext.mask_lora_has_amx(b16, RANK):
        return None
    out = []
    for layer in adapters:
        row = []
        for (k, n), (a, bt) in zip(SHAPES, layer):
            p = torch.empty(ext.mask_lora_packed_size(k, n), dtype=torch.bfloat16)
            ext.mask_lora_pack(a.data_ptr(), bt.data_ptr(), p.data_ptr(), RANK, k, n, b16)
            row.append(p)
        out.append(row)
    return out


def _arms(rows: int, threads: int, adapters, packed, gen: torch.Generator) -> dict:
    from dspec import _backend

    ext = _backend.extension()
    xs = {k: torch.randn(TOTAL_ROWS, k, generator=gen).bfloat16() for k in (576, 1536)}
    ys = {n: torch.randn(TOTAL_ROWS, n, generator=gen).bfloat16() for n in (192, 576, 1536)}
    index = torch.randperm(TOTAL_ROWS, generator=gen)[:rows].contiguous()
    b16 = _backend.FLOAT_CODE[torch.bfloat16]

    def cpp(isa):
        # only the amx arm passes the packed adapter ('auto' without it runs the AVX-512 code)
        addresses = (
            [[p.data_ptr() if isa == "amx" else 0 for p in row] for row in packed]
            if packed
            else [[0] * len(SHAPES) for _ in adapters]
        )

        def run():
            for layer, row in zip(adapters, addresses):
                for (k, n), (a, bt), p in zip(SHAPES, layer, row):
                    ext.mask_lora(
                        ys[n].data_ptr(),
                        xs[k].data_ptr(),
                        index.data_ptr(),
                        a.data_ptr(),
                        bt.data_ptr(),
                        2.0,
                        b16,
                        rows,
                        TOTAL_ROWS,
                        k,
                        n,
                        RANK,
                        threads,
                        b16,
                        isa,
                        p,
                    )

        return run

    float_adapters = [[(a.float(), bt.float().t().contiguous()) for a, bt in layer] for layer in adapters]

    def torch_update():
        for layer in float_adapters:
            for (k, n), (a, b) in zip(SHAPES, layer):
                picked = xs[k].index_select(0, index).float()
                delta = F.linear(F.linear(picked, a), b) * 2.0
                ys[n].index_add(0, index, delta.to(torch.bfloat16))

    arms = {"cpp": cpp("auto"), "cpp-generic": cpp("generic")}
    if packed is not None:
        arms["cpp-amx"] = cpp("amx")
    if threads == 1:
        arms["torch"] = torch_update
    return arms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", default=None, help="all-thread count (default: dspec's)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    from dspec.cpu import apply_threads, loadavg

    many = apply_threads(args.threads)
    env = environment("cpu")
    gen = torch.Generator().manual_seed(0)
    adapters = _adapters(gen)
    packed = _packed(adapters)
    runs = {}
    for m in [int(r) for r in args.rows.split(",")]:
        for t in sorted({1, many}):
            for name, fn in _arms(m, t, adapters, packed, gen).items():
                runs[(m, t, name)] = fn
    raw = {key: [] for key in runs}
    torch.set_num_threads(1)  # the torch arm on one thread, as in a decode step
    for rep in range(args.warmup + args.reps):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if rep >= args.warmup:
                raw[key].append((time.perf_counter() - t0) * 1e6)
    rows = []
    for (m, t, name), v in raw.items():
        s = sorted(v)
        flops = 2.0 * m * RANK * sum(k + n for k, n in SHAPES) * LAYERS
        med = statistics.median(s)
        rows.append(
            {
                "rows": m,
                "threads": t,
                "arm": name,
                "median_us": med,
                "p20_us": s[len(s) // 5],
                "p80_us": s[(4 * len(s)) // 5],
                "us_per_row_layer": med / m / LAYERS,
                "GFLOP_s": flops / med / 1e3,
                "raw_us": [round(x, 1) for x in v],
            }
        )
        print(
            f"M {m:3d} threads {t} {name:12s} {med:9.1f} us per forward "
            f"({med / m / LAYERS:6.2f} us per row and layer, "
            f"{flops / med / 1e3:6.1f} GFLOP/s)",
            flush=True,
        )
    payload = {
        "bench": "mask_lora",
        "env": env,
        "loadavg_end": loadavg(),
        "shape": {
            "layers": LAYERS,
            "rank": RANK,
            "projections": SHAPES,
            "dtype": "bfloat16",
            "adapter_dtype": "bfloat16",
        },
        "rows": rows,
    }
    base = out_dir(args, "cpu")
    write_json(base / "mask_lora.json", payload)
    if not args.no_plot:
        plot(payload, base / "mask_lora.png")
    return 0


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in payload["rows"]:
        series.setdefault((r["arm"], r["threads"]), []).append((r["rows"], r["median_us"] / 1e3))
    for (arm, t), pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{arm}, {t} thread{'s' if t > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("[MASK] rows in the forward")
    ax.set_ylabel("ms per forward (30 layers x 7 projections)")
    cpu = payload["env"].get("cpu", {}).get("cpu_model", "CPU")
    ax.set_title(f"mask_lora, rank 16, bf16 -- {cpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

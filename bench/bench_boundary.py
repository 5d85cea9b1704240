"""Benchmark boundary_posterior, rejection_boundaries and expected_accept_length (launch-bound).

conf is float32 [B, L] in [0.5, 1).  Roofline bytes: ``B * L * 4`` read plus the outputs:
boundary_posterior ``B * (L + 1) * 4``, rejection_boundaries ``B * k * 12`` (k = min(4, L)),
expected_accept_length ``B * 4``.  These inputs are KBs to a few MB, so the ops are
launch-bound: the number to read is median µs.  On CUDA each rep starts from an idle GPU
(synchronize before the start event), so the host-side launch cost is inside the interval;
no L2 flush (pass --flush to add one).  Value checks (a host sync) are off, as in an engine.

Backends: torch (dspec reference: several small kernels), triton on GPU (one fused launch).

    python bench/bench_boundary.py --device cpu --quick
    python bench/bench_boundary.py --device cuda --out /tmp/res
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tqdm import tqdm

import common

BENCH = "boundary"
PROVIDED = ("torch", "triton")


def cases(device: str, quick: bool) -> list[tuple[int, int]]:
    if quick:
        return (
            [(b, l) for l in (4, 16) for b in (1, 64)]
            if device == "cpu"
            else [(b, l) for l in (16, 64) for b in (1, 16384)]
        )
    return [(b, l) for l in (4, 16, 64) for b in (1, 64, 1024, 16384)]


def _check(got, ref) -> str:
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for g, r in zip(got, ref):
        if g.dtype.is_floating_point:
            if not torch.allclose(g, r, rtol=1e-4, atol=1e-6, equal_nan=True):
                return f"MISMATCH max|d|={float((g - r).abs().nan_to_num().max()):.2e}"
        elif not torch.equal(g, r):
            return f"MISMATCH ids x{int((g != r).sum())}"
    return "ok"


def main(argv=None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--flush", action="store_true", help="flush L2 between reps")
    args = parser.parse_args(argv)
    device, bw = common.setup(args)
    import dspec
    from dspec.reference import boundary as ref

    wanted = common.parse_backends(args.backends)
    backends = common.select(["torch"] + common.available_backends(device, PROVIDED[1:]), wanted)
    reps, warmup = common.reps_for(args, device, default_gpu=50, default_cpu=20, quick=5)
    flush = args.flush and not args.no_flush
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
            "sync_before_each_rep": device == "cuda",
            "conf": "uniform [0.5, 1) float32",
            "k": "min(4, L)",
            "validate_values": False,
            "bytes": {
                "boundary_posterior": "B*L*4 + B*(L+1)*4",
                "rejection_boundaries": "B*L*4 + B*k*12",
                "expected_accept_length": "B*L*4 + B*4",
            },
        },
    )
    print(f"backends: {backends}; {len(all_cases)} cases x 3 ops; reps={reps} warmup={warmup}")

    g = torch.Generator(device=device).manual_seed(args.seed)
    for batch, length in tqdm(all_cases, desc=BENCH, file=sys.stdout, mininterval=2):
        conf = 0.5 + 0.5 * torch.rand(batch, length, generator=g, device=device)
        k = min(4, length)
        read = batch * length * 4
        ops = (
            (
                "boundary_posterior",
                read + batch * (length + 1) * 4,
                lambda be: dspec.boundary_posterior(conf, backend=be),
                lambda: ref.boundary_posterior(conf),
            ),
            (
                "rejection_boundaries",
                read + batch * k * 12,
                lambda be: dspec.rejection_boundaries(conf, k, backend=be),
                lambda: ref.rejection_boundaries(conf, k),
            ),
            (
                "expected_accept_length",
                read + batch * 4,
                lambda be: dspec.expected_accept_length(conf, backend=be),
                lambda: ref.expected_accept_length(conf),
            ),
        )
        case = f"{batch}x{length}"
        out_rows = []
        for op, nbytes, call, reference in ops:
            expect = None if args.no_check else reference()
            for name in backends:
                fn = lambda c=call, n=name: c(n)
                try:
                    check = None if expect is None else _check(fn(), expect)
                    t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush, sync_before=device == "cuda")
                except Exception as exc:  # noqa: BLE001
                    rec.error(f"{op} {case} {name}: {type(exc).__name__}: {exc}")
                    continue
                out_rows.append(
                    common.make_row(
                        op=op,
                        backend=name,
                        case=case,
                        params={"B": batch, "L": length, "k": k},
                        dtype="fp32",
                        timing=t,
                        bytes_moved=nbytes,
                        copy_GBs=rec.copy_GBs,
                        check=check,
                    )
                )
        rec.add(out_rows)

    rec.finish(plot_kwargs={"metric": "median_us", "panel_keys": ("op",)}, no_plot=args.no_plot)
    cols = ["op", "case", "backend", "median_us", "p20_us", "p80_us", "GB_s", "speedup_vs_torch", "check"]
    print(common.fmt_table(rec.rows, cols))
    return 1 if rec.payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

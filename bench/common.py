"""Shared benchmark plumbing: timing, bandwidth reference, environment record, JSON + PNG output.

Every ``bench_*.py`` script builds a list of *cases*; each case is timed once per backend and
becomes one result row (see :func:`make_row`).  Results are written after every case, so a
run killed by a timeout still leaves the rows measured so far.

Timing
------
* CUDA: CUDA events around each rep, after ``warmup`` untimed calls.  Optionally the L2
  cache is flushed before each rep by writing a buffer larger than L2 (outside the timed
  interval).  ``sync_before=True`` synchronises before each rep so that the host-side launch
  cost falls inside the interval (launch-bound kernels).
* CPU: ``time.perf_counter`` around each rep.

Bytes / roofline
----------------
``bytes_moved`` is what the op *must* move: one read of its input plus its outputs.
``GB_s = bytes_moved / median`` and ``pct_of_copy_bw`` compares that with the measured
device-to-device copy bandwidth (``2 * bytes / time`` of a large ``dst.copy_(src)``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # run as `python bench/bench_x.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from dspec._cli import dumps  # noqa: E402  (strict JSON: non-finite floats as null)
from dspec.bench_e2e import device_name, device_slug  # noqa: E402  (one copy of the machine helpers)

ANCHOR = "chain"  # backend name of the naive multi-kernel PyTorch anchor rows
REFERENCE = "torch"  # backend name of the dspec torch reference rows

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    default_dev = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=default_dev,
        help=f"device to benchmark on (default: {default_dev})",
    )
    p.add_argument("--quick", action="store_true", help="tiny shape set and few reps (CPU smoke test, < 60 s)")
    p.add_argument("--out", default=None, help="output directory (default: bench/results/<device-slug>/)")
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to run, e.g. torch,triton,cuda,cpp,chain "
        "(default: every one available on the device)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed reps per measurement")
    p.add_argument("--warmup", type=int, default=None, help="untimed warmup calls")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between reps")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-check", action="store_true", help="skip the per-case output check against the torch reference")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_backends(arg: str | None) -> set[str] | None:
    if not arg:
        return None
    return {b.strip().lower() for b in arg.split(",") if b.strip()}


def available_backends(device: str, provided: Iterable[str]) -> list[str]:
    """The dspec backends an op provides that can run on ``device`` in this install.

    Triton is benchmarked on CUDA only (the CPU interpreter is a correctness tool; with
    ``TRITON_INTERPRET=1`` in the environment it is included on CPU too, to smoke-test the
    bench scripts themselves); the compiled ``cpp`` / ``cuda`` backends need ``dspec._C``.
    """
    from dspec import _backend

    out = []
    for name in provided:
        if name == "torch":
            ok = True
        elif name == "triton":
            ok = _backend.triton_available() and (device == "cuda" or _backend.triton_interpret())
        elif name == "cuda":
            ok = device == "cuda" and _backend.cuda_available()
        elif name == "cpp":
            ok = device == "cpu" and _backend.cpp_available()
        else:
            ok = False
        if ok:
            out.append(name)
    return out


def select(backends: list[str], wanted: set[str] | None) -> list[str]:
    return [b for b in backends if wanted is None or b in wanted]


# --------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_FLUSH: dict[tuple, torch.Tensor] = {}


def _flush_buffer(device: str, nbytes: int | None = None) -> torch.Tensor:
    """A buffer larger than the last-level cache (256 MiB on GPU: H100/H200 L2 is 50-60 MB;
    64 MiB on CPU unless ``nbytes`` says more -- this project's Xeon has a 300 MiB L3)."""
    if nbytes is None:
        nbytes = (256 << 20) if device == "cuda" else (64 << 20)
    key = (device, nbytes)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
    return _FLUSH[key]


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not sorted_vals:
        return float("nan")
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def time_fn(
    fn: Callable[[], object],
    device: str,
    *,
    reps: int = 20,
    warmup: int = 5,
    flush: bool = True,
    sync_before: bool = False,
    flush_bytes: int | None = None,
) -> dict:
    """Time ``fn()``; returns ``{"median_us", "p20_us", "p80_us", "raw_us"}``.  ``flush``
    rewrites a buffer of ``flush_bytes`` (default: :func:`_flush_buffer`'s) before each rep."""
    for _ in range(max(0, warmup)):
        fn()
    _sync(device)
    buf = _flush_buffer(device, flush_bytes) if flush else None
    raw: list[float] = []
    if device == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if buf is not None:
                buf.zero_()
            if sync_before:
                torch.cuda.synchronize()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        raw = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            if buf is not None:
                buf.zero_()
            t0 = time.perf_counter()
            fn()
            raw.append((time.perf_counter() - t0) * 1e6)
    s = sorted(raw)
    return {
        "median_us": statistics.median(s),
        "p20_us": _percentile(s, 20),
        "p80_us": _percentile(s, 80),
        "raw_us": [round(v, 3) for v in raw],
    }


# --------------------------------------------------------------------------------------
# bandwidth reference
# --------------------------------------------------------------------------------------
def measure_bandwidth(device: str, *, quick: bool = False) -> dict:
    """Measured copy bandwidth (read + write) and a read-only estimate (a ``.sum()``), GB/s."""
    if device == "cuda":
        nbytes = 1 << 30
    else:
        # 1 GiB: several times a server CPU's last-level cache (260 MB on the Xeons these
        # benches ran on), so that the read figure is DRAM's, not the cache's
        nbytes = (64 << 20) if quick else (1 << 30)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    reps = 10 if device == "cuda" else 5
    t_copy = time_fn(lambda: dst.copy_(src), device, reps=reps, warmup=2, flush=False)
    t_read = time_fn(lambda: src.sum(), device, reps=reps, warmup=2, flush=False)
    src = dst = None  # frees the tensors; not `del`: closures above read them
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy_bytes": nbytes,
        "copy_GBs": 2 * nbytes / (t_copy["median_us"] * 1e3),
        "read_GBs": nbytes / (t_read["median_us"] * 1e3),
        "copy_median_us": t_copy["median_us"],
        "read_median_us": t_read["median_us"],
    }


# --------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: str) -> dict:
    env = {
        "device": device,
        "device_name": device_name(device),
        "device_slug": device_slug(device),
        "hostname": socket.gethostname(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
        "git_commit": _run(["git", "rev-parse", "HEAD"]),
        "git_dirty": None,
    }
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    if status is not None:
        env["git_dirty"] = bool(status)
    if not device.startswith("cuda"):
        from dspec.cpu import machine

        env["cpu"] = machine()  # model, flags, cores, threads, load average
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton missing or broken is just recorded
        env["triton"] = None
    try:
        from dspec import _backend

        env["dspec_cpp"] = _backend.cpp_available()
        env["dspec_cuda"] = _backend.cuda_available()
    except Exception as exc:  # noqa: BLE001
        env["dspec_import_error"] = repr(exc)
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
        env["gpu_mem_GiB"] = round(props.total_memory / 2**30, 1)
        smi = _run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        )
        env["nvidia_smi"] = smi
        if smi:
            parts = [p.strip() for p in smi.splitlines()[0].split(",")]
            if len(parts) > 1:
                env["driver"] = parts[1]
    return env


# --------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------
def make_row(
    *,
    op: str,
    backend: str,
    case: str,
    params: dict,
    dtype: str,
    timing: dict,
    bytes_moved: int,
    copy_GBs: float,
    check: str | None = None,
    extra: dict | None = None,
) -> dict:
    med = timing["median_us"]
    gbs = bytes_moved / (med * 1e3) if med > 0 else float("nan")
    row = {
        "op": op,
        "backend": backend,
        "case": case,
        **params,
        "dtype": dtype,
        "median_us": round(med, 3),
        "p20_us": round(timing["p20_us"], 3),
        "p80_us": round(timing["p80_us"], 3),
        "bytes_moved": int(bytes_moved),
        "GB_s": round(gbs, 3),
        "pct_of_copy_bw": round(100.0 * gbs / copy_GBs, 1),
        "speedup_vs_torch": None,
        "speedup_vs_chain": None,
        "check": check,
        "reps": len(timing["raw_us"]),
        "raw_us": timing["raw_us"],
    }
    if extra:
        row.update(extra)
    return row


def add_speedups(rows: list[dict]) -> None:
    """Fill speedup_vs_torch / speedup_vs_chain from the rows of the same (op, case, dtype)."""
    ref: dict[tuple, dict] = {}
    for r in rows:
        key = (r["op"], r["case"], r["dtype"])
        if r["backend"] in (REFERENCE, ANCHOR):
            ref[key + (r["backend"],)] = r
    for r in rows:
        key = (r["op"], r["case"], r["dtype"])
        for name, field in ((REFERENCE, "speedup_vs_torch"), (ANCHOR, "speedup_vs_chain")):
            base = ref.get(key + (name,))
            if base is not None and r["median_us"] > 0:
                r[field] = round(base["median_us"] / r["median_us"], 2)


def out_dir(args, device: str) -> Path:
    d = Path(args.out) if args.out else BENCH_DIR / "results" / device_slug(device)
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


class Recorder:
    """Collects rows for one bench and rewrites ``<out>/<bench>.json`` after every case."""

    def __init__(self, bench: str, args, device: str, bandwidth: dict, config: dict):
        self.bench = bench
        self.device = device
        self.dir = out_dir(args, device)
        self.path = self.dir / f"{bench}.json"
        self.payload = {
            "bench": bench,
            "env": environment(device),
            "bandwidth": bandwidth,
            "config": config,
            "complete": False,
            "errors": [],
            "results": [],
        }
        self.copy_GBs = bandwidth["copy_GBs"]

    @property
    def rows(self) -> list[dict]:
        return self.payload["results"]

    def add(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        add_speedups(self.rows)
        write_json(self.path, self.payload)

    def error(self, msg: str) -> None:
        self.payload["errors"].append(msg)
        print(f"[{self.bench}] ERROR {msg}", file=sys.stderr)
        write_json(self.path, self.payload)

    def finish(self, plot_kwargs: dict | None = None, no_plot: bool = False) -> Path:
        self.payload["complete"] = True
        add_speedups(self.rows)
        write_json(self.path, self.payload)
        if not no_plot and self.rows:
            try:
                png = plot_results(self.payload, self.dir / f"{self.bench}.png", **(plot_kwargs or {}))
                print(f"wrote {png}")
            except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the JSON
                print(f"plot failed: {exc!r}", file=sys.stderr)
        print(f"wrote {self.path}")
        return self.path


# --------------------------------------------------------------------------------------
# plotting
# --------------------------------------------------------------------------------------
_COLORS = {"torch": "tab:gray", ANCHOR: "tab:red", "triton": "tab:blue", "cuda": "tab:green", "cpp": "tab:orange"}


def plot_results(
    payload: dict, path: Path, *, metric: str | None = None, panel_keys: tuple[str, ...] = ("op", "dtype")
) -> Path:
    """One panel per (op, dtype); x = case, one line per backend; y = GB/s (with the copy
    bandwidth as a horizontal line) or median µs for launch-bound benches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    metric = metric or "GB_s"
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault(tuple(r[k] for k in panel_keys), []).append(r)
    n = len(panels)
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    copy_bw = payload["bandwidth"]["copy_GBs"]
    for ax, (key, prs) in zip(axes.flat, panels.items()):
        cases = list(dict.fromkeys(r["case"] for r in prs))
        xs = {c: i for i, c in enumerate(cases)}
        for backend in dict.fromkeys(r["backend"] for r in prs):
            br = [r for r in prs if r["backend"] == backend]
            ax.plot(
                [xs[r["case"]] for r in br],
                [r[metric] for r in br],
                marker="o",
                ms=3,
                label=backend,
                color=_COLORS.get(backend),
            )
        if metric == "GB_s":
            ax.axhline(copy_bw, ls="--", color="k", lw=1, label=f"copy {copy_bw:.0f} GB/s")
            ax.set_ylabel("GB/s (roofline bytes / median)")
        else:
            ax.set_ylabel("median µs")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
        ax.set_title(" / ".join(str(k) for k in key), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    env = payload["env"]
    fig.suptitle(f"{payload['bench']} on {env['device_name']} ({env.get('date', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------
# helpers used by several benches
# --------------------------------------------------------------------------------------
def setup(args) -> tuple[str, dict]:
    """Common start: seed, device check, dspec config; returns (device, bandwidth)."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
    torch.manual_seed(args.seed)
    import dspec

    # engine mode: no value checks that copy to the host (they would add a sync per call)
    dspec.config.validate_values = False
    print(f"device: {device_name(device)}; measuring bandwidth ...", flush=True)
    bw = measure_bandwidth(device, quick=args.quick)
    print(f"copy {bw['copy_GBs']:.1f} GB/s, read-only (sum) {bw['read_GBs']:.1f} GB/s", flush=True)
    return device, bw


def reps_for(args, device: str, default_gpu: int = 30, default_cpu: int = 10, quick: int = 3) -> tuple[int, int]:
    if args.quick:
        reps, warmup = quick, 1
    elif device == "cuda":
        reps, warmup = default_gpu, 5
    else:
        reps, warmup = default_cpu, 2
    return (args.reps or reps), (args.warmup if args.warmup is not None else warmup)


def random_logits(
    rows: int, vocab: int, dtype: torch.dtype, device: str, *, scale: float = 4.0, seed: int = 0
) -> torch.Tensor:
    """Gaussian logits (std ``scale``: a peaked-ish softmax), made in fp32 then cast."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=device, dtype=torch.float32)
    return x.mul_(scale).to(dtype)


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    """A small fixed-width text table for the console."""
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def free_cuda(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()

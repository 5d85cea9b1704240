"""Summarise bench JSON files: summary.md, one combined results.json, and a PNG per bench.

    python bench/summarize.py DIR [--out OUT_DIR] [--no-plots] [--plots a,b] [--print]

Reads every ``DIR/*.json`` written by a ``bench_*.py`` script (``results.json`` itself is
skipped), then writes into OUT_DIR (default DIR):

* ``summary.md``: environment, the token_stats headline (1024 x 151936 bf16: % of copy
  bandwidth, speedup over the PyTorch chain, against the >= 80 % / >= 3x targets), the
  verify headline (verify_chain B=64 L=16 V=151936 T=1 with draft_probs: >= 1.5x faster
  than flashinfer softmax + chain_speculative_sampling and <= 1.5x the roofline time,
  PASS / FAIL / not-measured; see bench_verify.py), the cascade_attention headline (triton
  <= 1.3x the roofline at prefix >= 4096 and never slower than the best SDPA / flashinfer
  baseline, PASS / FAIL / not-measured, plus its fused-vs-split table and the skipped
  cases; see bench_cascade_attention.py), then one
  compact table per bench (one line per op / case / dtype: median µs per backend, and for
  the fastest dspec kernel backend its GB/s, % of copy bandwidth and speedups), then every
  row in long form (op, shape, backend, median µs, GB/s, % copy BW, speedup vs torch).
* ``results.json``: ``{"benches": {name: <the bench JSON without raw timings>}}``.
* ``<bench>.png`` per bench (unless --no-plots; ``--plots a,b`` limits them to those benches).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

BACKEND_ORDER = [
    "torch",
    common.ANCHOR,
    "torch_plain",
    "sdpa_dense",
    "sdpa_branch",
    "flashinfer",
    "flashinfer_mask",
    "flashinfer_cascade",
    "triton",
    "triton_fused",
    "cuda",
    "cpp",
]
KERNEL_BACKENDS = ("triton", "cuda", "cpp")
HEADLINE = {"op": "token_stats", "rows": 1024, "V": 151936, "dtype": "bf16"}


def load(dir_: Path) -> dict[str, dict]:
    benches = {}
    for path in sorted(dir_.glob("*.json")):
        if path.name == "results.json":
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skip {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict) and "bench" in data and "results" in data:
            benches[data["bench"]] = data
    return benches


def _check_ok(check) -> bool:
    """No check ran, or it passed ("ok", possibly with a note such as rounding ties)."""
    return check is None or str(check).startswith("ok")


def _f(v, nd=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _md_table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def headline(benches: dict) -> list[str]:
    data = benches.get("token_stats")
    if not data:
        return []
    hits = [r for r in data["results"] if all(r.get(k) == v for k, v in HEADLINE.items())]
    if not hits:
        return []
    bw = data["bandwidth"]["copy_GBs"]
    out = [
        f"## Headline: token_stats 1024 x 151936 bf16 "
        f"(copy bandwidth {bw:.0f} GB/s; targets >= 80 % of it and >= 3x the chain)",
        "",
    ]
    lines = []
    for r in sorted(hits, key=lambda r: BACKEND_ORDER.index(r["backend"]) if r["backend"] in BACKEND_ORDER else 99):
        verdict = ""
        if r["backend"] in KERNEL_BACKENDS:
            ok_bw = r["pct_of_copy_bw"] >= 80
            ok_sp = (r.get("speedup_vs_chain") or 0) >= 3
            verdict = f"BW {'PASS' if ok_bw else 'FAIL'}, speedup {'PASS' if ok_sp else 'FAIL'}"
        lines.append(
            [
                r["backend"],
                _f(r["median_us"]),
                _f(r["GB_s"]),
                _f(r["pct_of_copy_bw"]),
                _f(r.get("speedup_vs_chain"), 2),
                _f(r.get("speedup_vs_torch"), 2),
                r.get("check") or "-",
                verdict,
            ]
        )
    out.append(
        _md_table(["backend", "median µs", "GB/s", "% copy BW", "x vs chain", "x vs torch", "check", "verdict"], lines)
    )
    out.append("")
    return out


def verify_headline(benches: dict, markdown: bool = True) -> list[str]:
    """The verify headline with PASS / FAIL / not-measured (logic lives in bench_verify.py)."""
    data = benches.get("verify")
    if not data:
        return []
    try:
        import bench_verify  # same folder (sys.path set above)
    except Exception as exc:  # noqa: BLE001
        return [f"(verify headline unavailable: cannot import bench_verify: {exc!r})", ""]
    lines = bench_verify.headline_lines(data, markdown=markdown)
    fi = data.get("env", {}).get("flashinfer")
    err = data.get("env", {}).get("flashinfer_error")
    note = f"flashinfer: {fi}" + (f"; error: {err}" if err else "")
    return lines + ([note, ""] if markdown else [note])


def cascade_headline(benches: dict, markdown: bool = True) -> list[str]:
    """cascade_attention: headline verdicts, fused-vs-split table, skipped cases (logic in
    bench_cascade_attention.py)."""
    data = benches.get("cascade_attention")
    if not data:
        return []
    try:
        import bench_cascade_attention as bca  # same folder
    except Exception as exc:  # noqa: BLE001
        return [f"(cascade_attention headline unavailable: cannot import its bench: {exc!r})", ""]
    lines = bca.headline_lines(data, markdown=markdown)
    lines += ([""] if not markdown else []) + bca.fused_split_lines(data, markdown=markdown)
    skipped = data.get("skipped") or []
    if skipped:
        if markdown:
            lines += (
                [f"cascade_attention skipped ({len(skipped)}):", ""]
                + [f"- {s['case']} {s['backend']}: {s['reason']}" for s in skipped]
                + [""]
            )
        else:
            lines.append(f"cascade_attention: {len(skipped)} skipped (see summary.md)")
    return lines


# plot_results arguments per bench (default: GB/s, one panel per (op, dtype))
PLOT_KWARGS = {
    "boundary": {"metric": "median_us", "panel_keys": ("op",)},
    "verify": {"panel_keys": ("op", "mode")},
    "cascade_attention": {"metric": "median_us", "panel_keys": ("heads", "prefix")},
}


# extra per-row columns some benches add (shown when any row of the bench has them)
EXTRA_COLS = [
    ("x_roofline", "x roofline", 2),
    ("speedup_vs_plain", "x vs plain", 2),
    ("speedup_vs_flashinfer", "x vs flashinfer", 2),
    ("mean_accepted", "mean acc", 2),
    ("tflops", "TFLOP/s", 1),
    ("speedup_vs_best_baseline", "x vs best baseline", 2),
    ("num_splits", "splits", 0),
]


def _extra_cols(rows: list[dict]) -> list[tuple]:
    return [c for c in EXTRA_COLS if any(r.get(c[0]) is not None for r in rows)]


def compact(data: dict) -> list[str]:
    """One line per (op, case, dtype): µs per backend + the best kernel backend's numbers."""
    rows = data["results"]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["case"], r["dtype"]), {})[r["backend"]] = r
    present = [b for b in BACKEND_ORDER if any(b in g for g in groups.values())]
    present += sorted({b for g in groups.values() for b in g} - set(present))
    extra = _extra_cols(rows)
    header = (
        ["op", "shape", "dtype"]
        + [f"{b} µs" for b in present]
        + ["best", "GB/s", "% copy BW", "x vs torch", "x vs chain"]
        + [c[1] for c in extra]
        + ["checks"]
    )
    lines = []
    for (op, case, dtype), by_backend in groups.items():
        kernels = [by_backend[b] for b in KERNEL_BACKENDS if b in by_backend]
        best = (
            min(kernels, key=lambda r: r["median_us"])
            if kernels
            else min(by_backend.values(), key=lambda r: r["median_us"])
        )
        bad = [f"{b}:{r['check']}" for b, r in by_backend.items() if not _check_ok(r.get("check"))]
        lines.append(
            [op, case, dtype]
            + [_f(by_backend[b]["median_us"]) if b in by_backend else "-" for b in present]
            + [
                best["backend"],
                _f(best["GB_s"]),
                _f(best["pct_of_copy_bw"]),
                _f(best.get("speedup_vs_torch"), 2),
                _f(best.get("speedup_vs_chain"), 2),
            ]
            + [_f(best.get(c[0]), c[2]) for c in extra]
            + ["; ".join(bad) if bad else "ok"]
        )
    return [_md_table(header, lines), ""]


def long_table(data: dict) -> list[str]:
    extra = _extra_cols(data["results"])
    header = (
        ["op", "shape", "dtype", "backend", "median µs", "p20", "p80", "GB/s", "% copy BW", "x vs torch", "x vs chain"]
        + [c[1] for c in extra]
        + ["check"]
    )
    lines = [
        [
            r["op"],
            r["case"],
            r["dtype"],
            r["backend"],
            _f(r["median_us"]),
            _f(r["p20_us"]),
            _f(r["p80_us"]),
            _f(r["GB_s"]),
            _f(r["pct_of_copy_bw"]),
            _f(r.get("speedup_vs_torch"), 2),
            _f(r.get("speedup_vs_chain"), 2),
        ]
        + [_f(r.get(c[0]), c[2]) for c in extra]
        + [r.get("check") or "-"]
        for r in data["results"]
    ]
    return [_md_table(header, lines), ""]


def render(benches: dict) -> str:
    first = next(iter(benches.values()))
    env, bw = first["env"], first["bandwidth"]
    out = [
        "# dspec benchmark summary",
        "",
        f"- device: **{env.get('device_name')}** ({env.get('device')}, driver "
        f"{env.get('driver', '-')}, SMs {env.get('sm_count', '-')})",
        f"- measured copy bandwidth **{bw['copy_GBs']:.1f} GB/s** (2 x bytes / time of a "
        f"{bw['copy_bytes'] >> 20} MiB copy), read-only (sum) {bw['read_GBs']:.1f} GB/s",
        f"- torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}, "
        f"dspec._C cpp={env.get('dspec_cpp')} cuda={env.get('dspec_cuda')}",
        f"- commit {env.get('git_commit')} (dirty={env.get('git_dirty')}), {env.get('hostname')}, {env.get('date')}",
        "- GB/s = roofline bytes (one read of the input + the outputs) / median time; "
        "speedups are torch-reference (or chain) median / this median.",
        "",
    ]
    out += headline(benches)
    out += verify_headline(benches)
    out += cascade_headline(benches)
    for name, data in benches.items():
        status = "" if data.get("complete") else " — INCOMPLETE (run stopped early)"
        out += [
            f"## {name}{status}",
            "",
            f"copy bandwidth {data['bandwidth']['copy_GBs']:.1f} GB/s; "
            f"config: `{json.dumps(data.get('config', {}), default=str)}`",
            "",
        ]
        if data.get("errors"):
            out += ["Errors:", ""] + [f"- {e}" for e in data["errors"]] + [""]
        if data["results"]:
            out += compact(data)
    out += ["## All rows", ""]
    for name, data in benches.items():
        if data["results"]:
            out += ["<details><summary>" + name + "</summary>", ""] + long_table(data) + ["</details>", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="directory holding the bench_*.py JSON files")
    p.add_argument("--out", type=Path, default=None, help="where to write (default: DIR)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--plots", default=None, help="comma-separated benches to draw a PNG for (default: every bench)")
    p.add_argument("--print", action="store_true", help="print the whole summary.md")
    args = p.parse_args(argv)
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    benches = load(args.dir)
    if not benches:
        print(f"no bench JSON in {args.dir}", file=sys.stderr)
        (out / "summary.md").write_text(f"# dspec benchmark summary\n\nNo results in {args.dir}.\n")
        return 1
    text = render(benches)
    (out / "summary.md").write_text(text)
    slim = {
        name: {**data, "results": [{k: v for k, v in r.items() if k != "raw_us"} for r in data["results"]]}
        for name, data in benches.items()
    }
    common.write_json(out / "results.json", {"benches": slim})
    plots = None if args.plots is None else {b.strip() for b in args.plots.split(",") if b.strip()}
    if not args.no_plots:
        for name, data in benches.items():
            if not data["results"] or (plots is not None and name not in plots):
                continue
            kw = PLOT_KWARGS.get(name, {})
            try:
                common.plot_results(data, out / f"{name}.png", **kw)
            except Exception as exc:  # noqa: BLE001
                print(f"plot {name} failed: {exc!r}", file=sys.stderr)
    if args.print:
        print(text)
    else:
        print("\n".join(headline(benches)) or "(no token_stats headline case in these results)")
        if "verify" in benches:
            print("\n".join(verify_headline(benches, markdown=False)))
        if "cascade_attention" in benches:
            print("\n".join(cascade_headline(benches, markdown=False)))
        for name, data in benches.items():
            n_bad = sum(1 for r in data["results"] if not _check_ok(r.get("check")))
            print(
                f"{name}: {len(data['results'])} rows, complete={data.get('complete')}, "
                f"errors={len(data.get('errors', []))}, check mismatches={n_bad}"
            )
    print(f"wrote {out / 'summary.md'} and {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The end-to-end grid (``python -m dspec bench`` JSON) as one Markdown table, pooled over
prompt sets: per configuration, tokens/s (all completion tokens / all wall time), speedup
over ``ar`` and over one-token-per-step and dynamic diffusion (ratios of pooled tokens/s in
the same run), completion tokens per target forward, mean accepted (mean over sets),
accuracy (arithmetic, MATH500: checked answers pooled) and the share of outputs equal to
the lossless reference; a second JSON (the fp32 run) adds its same-as-reference column.

    python bench/e2e_table.py bench/results/cpu/amx/e2e_smollm2.json bench/results/cpu/amx/e2e_smollm2_fp32.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pooled(payload: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for s in payload["summary"]:
        if s.get("kind") != "summary":
            continue
        r = out.setdefault(
            s["config"],
            {
                "method": s["method"],
                "tokens": 0,
                "wall": 0.0,
                "nfe": 0,
                "acc": [],
                "checked": 0,
                "correct": 0.0,
                "same": [],
            },
        )
        r["tokens"] += s["new_tokens"]
        r["wall"] += s["wall_s"]
        r["nfe"] += s["nfe_target"]
        r["acc"].append(s["mean_accepted"])
        if s.get("checked"):
            r["checked"] += s["checked"]
            r["correct"] += s["accuracy"] * s["checked"]
        if s.get("same_as_reference") is not None:
            r["same"].append((s["same_as_reference"], s["requests"]))
    return out


def same_share(rows: list[tuple[float, int]]) -> str:
    if not rows:
        return "-"
    n = sum(k for _, k in rows)
    return f"{sum(v * k for v, k in rows) / n:.2f}"


def table(main: dict, fp32: dict | None = None) -> str:
    rows = pooled(main)
    exact = pooled(fp32) if fp32 else {}
    tps = {name: r["tokens"] / r["wall"] for name, r in rows.items() if r["wall"] > 0}

    def ratio(name, base):
        return f"{tps[name] / tps[base]:.2f}x" if base in tps and name in tps else "-"

    head = [
        "config",
        "tok/s",
        "vs ar",
        "vs diffusion 1/step",
        "vs dynamic",
        "tokens / target fwd",
        "mean accepted",
        "accuracy",
        "= reference (bf16)",
        "= reference (fp32)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        acc = f"{r['correct'] / r['checked']:.2f} ({r['checked']})" if r["checked"] else "-"
        ex = same_share(exact[name]["same"]) if name in exact else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{name}`",
                    f"{tps.get(name, 0):.1f}",
                    ratio(name, "ar"),
                    ratio(name, "diffusion-static-1"),
                    ratio(name, "diffusion-dynamic"),
                    f"{r['tokens'] / max(r['nfe'], 1):.2f}",
                    f"{sum(r['acc']) / len(r['acc']):.2f}",
                    acc,
                    same_share(r["same"]),
                    ex,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("fp32_json", type=Path, nargs="?")
    a = p.parse_args()
    main_payload = json.loads(a.json.read_text())
    fp32 = json.loads(a.fp32_json.read_text()) if a.fp32_json else None
    print(table(main_payload, fp32))


if __name__ == "__main__":
    main()

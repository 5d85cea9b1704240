"""Which thread count to decode with: `ar` tokens/s for 1 thread, every core, and dspec's
auto policy (``dspec.cpu.default_threads``), alone and beside one busy process (a spinning
Python loop: another job on a shared machine).

Each measurement runs in a fresh subprocess (torch's thread pool is fixed per process).

    python bench/bench_threads.py [--model smollm2-135m] [--tokens 32]
Writes bench/results/cpu/threads.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, out_dir, write_json

CHILD = r"""
import json, sys, torch, dspec
from dspec.cpu import apply_threads
n = apply_threads(sys.argv[1])
m = dspec.load(sys.argv[2])
ids = m.tokenizer.encode("def fibonacci(n):\n    " * 10)
dspec.generate(m, ids, method="ar", max_new_tokens=4)
g = dspec.generate(m, ids, method="ar", max_new_tokens=int(sys.argv[3]))
print(json.dumps({"threads": n, "tokens_per_s": g.stats["tokens_per_s"]}))
"""


def measure(threads: str, model: str, tokens: int, neighbour: bool) -> dict:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "DSPEC_NUM_THREADS")}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, threads, model, str(tokens)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    env = environment("cpu")
    cores = env["cpu"]["cores"]
    rows = []
    for neighbour in (False, True):
        for threads in ("1", str(cores), "auto"):
            r = measure(threads, args.model, args.tokens, neighbour)
            r.update(setting=threads, neighbour=neighbour)
            rows.append(r)
            print(
                f"{'busy neighbour' if neighbour else 'alone':15s} threads={threads:5s} "
                f"(-> {r['threads']}) {r['tokens_per_s']:6.1f} tok/s",
                flush=True,
            )
    payload = {"bench": "threads", "model": args.model, "tokens": args.tokens, "env": env, "results": rows}
    path = out_dir(args, "cpu") / "threads.json"
    write_json(path, payload)
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        labels = [f"{'busy' if r['neighbour'] else 'alone'}\n{r['setting']} (->{r['threads']})" for r in rows]
        ax.bar(
            range(len(rows)),
            [r["tokens_per_s"] for r in rows],
            color=["tab:blue" if not r["neighbour"] else "tab:orange" for r in rows],
        )
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(f"ar tokens/s ({args.model})")
        ax.set_title(f"threads: {env['cpu']['cpu_model']}, {cores} cores", fontsize=9)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=90)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

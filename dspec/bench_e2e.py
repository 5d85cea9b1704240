"""End-to-end benchmark grid: decoding configurations x prompt sets.

    python -m dspec bench [--dllm NAME|DIR] [--target NAME|DIR] [--drafter NAME|DIR]
                          [--configs ar,diffusion-dynamic,...] [--add-config SPEC ...]
                          [--prompt-sets arithmetic,humaneval,mtbench,math500] [--prompts N]
                          [--max-new-tokens N] [--batch B] [--temperature T] [--seed S]
                          [--device cpu|cuda] [--dtype D] [--threads N] [--quick]
                          [--out DIR] [--name STEM] [--no-plot] [--list-configs]
    python bench/bench_e2e.py ...            (the same, from a checkout)

A *configuration* is (name, method, options, model family): ``ar`` and the methods that
draft for an autoregressive target (``diffuspec``, ``dflash``, ``d2sd``) run on
``--target``; ``diffusion``, ``ssd``, ``spiffy`` and ``s2d2`` run on the block-diffusion
model ``--dllm``; one run covers both families.  ``--model M`` sets both.  A configuration
whose method is not implemented yet (not in ``dspec.decode.generate.available_methods()``),
whose model failed to load, or that its model cannot run (``ValueError`` from
``dspec.generate``: e.g. ``diffusion`` on a causal model) is skipped and the reason is
recorded in the JSON.

Prompt sets come from ``dspec.tasks.prompt_set``: ``arithmetic`` (checkable: accuracy by
``dspec.tasks.check_arithmetic``), ``humaneval`` (code prompts, raw), ``mtbench``
(questions) and ``math500`` (checkable by ``dspec.tasks.check_math``: the last ``\\boxed{}``);
the last two are wrapped in the model's chat template when it has one, raw otherwise.

Numbers, per (configuration, prompt set):

* ``tokens_per_s``: completion tokens (prompt excluded, up to and including EOS) over the
  summed wall time of the timed ``generate`` calls (tokenisation, prefill and decoding
  included); one untimed warm-up call per configuration comes first, then the timed calls
  go round robin over the configurations (each prompt by every configuration before the
  next prompt), so that a drifting machine speed lands on all of them alike;
* ``nfe``: model forwards per model role, summed over calls (a batched forward counts once);
  ``forwards_per_token`` per role = forwards x requests of the call / completion tokens
  (independent of the batch size);
* ``tokens_per_target_forward``: the target's inverse: completion tokens per request-forward
  of the model that runs the configuration;
* ``mean_accepted``: the method's own ``stats["mean_accepted"]``, averaged over calls weighted
  by completion tokens;
* ``accuracy``: share of correct answers where the set is checkable;
* ``same_as_reference`` (greedy runs): share of prompts on which a lossless method's text
  equals its reference configuration's (``ar`` for dflash / d2sd / diffuspec,
  ``diffusion-static-1`` for ssd / spiffy; ``s2d2-always`` against ``ar``): 1.0 in fp32; in
  bf16 a batched verification may round to another token than a one-token step;
* ``speedup_vs_ar``: tokens/s over the ``ar`` configuration's on the same prompts (on the
  target model); ``speedup_vs_dynamic``: for configurations on the dLLM, over
  ``diffusion-dynamic``'s;
* ``wall_split_s``: when a method reports time per phase (stats keys ending in ``_s``, e.g.
  ``draft_s``, ``search_s``, ``verify_s``), their sums.

Writes ``<out>/<name>.json`` (rewritten after every configuration) and ``<out>/<name>.png``.
Default out: ``bench/results/<device>/`` in a checkout, else ``./dspec-bench/<device>/``.
CPU numbers on a shared machine move with its load: the load average is recorded at the
start, after each configuration and at the end.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._cli import add_threads_argument, dumps, json_safe, parse_value, run_command
from .cpu import cpu_model, loadavg
from .models.embedded import is_chat_model

NAME = "e2e"
FAMILIES = ("target", "dllm")
PROMPT_SETS = ("arithmetic", "humaneval", "mtbench", "math500")
CHAT_SETS = ("mtbench", "math500")  # wrapped in the chat template for chat models
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Option:
    """A method option known under several possible names (methods are being written in
    parallel; the first name the method's ``OPTIONS`` declares is used)."""

    names: tuple[str, ...]
    value: object


@dataclass(frozen=True)
class Config:
    """One column of the grid: ``method`` with ``options`` on the ``family`` model."""

    name: str
    method: str
    family: str  # "target" or "dllm"
    options: dict = field(default_factory=dict)  # name -> value, or name -> Option
    expand: str | None = None  # "policies": one config per POLICIES entry


def _d2sd_k(k: int) -> Option:
    """D2SD's branch count K, under each name ``d2sd`` might declare for it."""
    return Option(("k", "num_branches", "top_k"), k)


# The default grid: every method and its ablations.
CONFIGS: tuple[Config, ...] = (
    Config("ar", "ar", "target"),
    Config("diffusion-static-1", "diffusion", "dllm", {"tokens_per_step": 1}),
    Config("diffusion-static-2", "diffusion", "dllm", {"tokens_per_step": 2}),
    Config("diffusion-dynamic", "diffusion", "dllm", {"threshold": 0.9}),
    Config("ssd", "ssd", "dllm"),
    # pinned draft rows per round: the CPU defaults at block size 4 are draft_len 3 with the
    # swapped states / prune_to 6 (32 rows, decode/cpu_cost.py); ssd-d2 / spiffy-p2 are the
    # earlier 16-row defaults (CPU_SMALL_ROW_BUDGET), ssd-d3 the chain without swaps, spiffy-p8 the default
    # on accelerators
    Config("ssd-d2", "ssd", "dllm", {"draft_len": 2, "mixed_order": False}),
    Config("ssd-d3", "ssd", "dllm", {"draft_len": 3, "mixed_order": False}),
    Config("spiffy", "spiffy", "dllm"),
    Config("spiffy-p2", "spiffy", "dllm", {"prune_to": 2}),
    Config("spiffy-p3", "spiffy", "dllm", {"prune_to": 3}),
    Config("spiffy-p8", "spiffy", "dllm", {"prune_to": 8}),
    Config("s2d2", "s2d2", "dllm", expand="policies"),
    # S2D2 as published: the speculative block alone (no redraft blocks), its default policy
    Config("s2d2-noredraft", "s2d2", "dllm", {"redraft": False}),
    # with the boundary state (off by default on a CPU, on elsewhere; decode/cpu_cost.py)
    Config("s2d2-boundary", "s2d2", "dllm", {"policy": "always", "boundary": True}),
    Config("diffuspec", "diffuspec", "target"),
    Config("diffuspec-d8", "diffuspec", "target", {"draft_len": 8}),
    # without the prompt-lookup branch (on by default on a CPU, greedy: the draft is then
    # verified as a tree with the lookup chain grafted on)
    Config("diffuspec-nolookup", "diffuspec", "target", {"lookup": None}),
    # ADL with the paper's bounds (the default elsewhere; a CPU model's are CPU_ADL's 4 / 12 / 2)
    Config("diffuspec-paper", "diffuspec", "target", {"k_min": 20, "k_max": 30, "delta": 10}),
    Config(
        "diffuspec-noCPS-noADL",
        "diffuspec",
        "target",
        {"cps": Option(("cps", "path_search"), False), "adl": Option(("adaptive", "adl", "adaptive_draft_len"), False)},
    ),
    Config("dflash", "dflash", "target"),
    # the adaptive verification length at a higher cost of a verified row (the default on a
    # CPU is row_cost 0.02), and every draft verified (the default elsewhere)
    Config("dflash-adaptive", "dflash", "target", {"row_cost": 0.06}),
    Config("dflash-full", "dflash", "target", {"row_cost": None}),
    # the draft tree (on a CPU, greedy, `dflash` verifies 7 tree nodes: tree="auto"): the
    # chain as published, 15 nodes (+ the root: one AMX tile pass of 16 rows) pruned at the
    # CPU's row cost, and 7 nodes every one verified
    Config("dflash-chain", "dflash", "target", {"tree": None}),
    Config("dflash-block", "dflash", "target", {"tree": None, "verify_rule": "block"}),
    Config("dflash-tree", "dflash", "target", {"tree": 15}),
    Config("dflash-tree7", "dflash", "target", {"tree": 7, "row_cost": None}),
    # without the prompt-lookup branch grafted onto the tree (on by default on a CPU, greedy)
    Config("dflash-nolookup", "dflash", "target", {"lookup": None}),
    # at T > 0 `dflash` verifies the chain with the drafter's q and no lookup; this verifies
    # the 7-node tree (drafts one-hot) with the lookup branch at any temperature
    Config("dflash-tree-lookup", "dflash", "target", {"tree": 7, "lookup": 7}),
    # D2SD with the VP-drafter's re-drafts in every cycle (redraft_min=0, the paper's method;
    # on a CPU the default gate never re-drafts: `d2sd-auto`, below)
    *(Config(f"d2sd-K{k}", "d2sd", "target", {"k": _d2sd_k(k), "redraft_min": 0}) for k in (1, 2, 4)),
    # the tree pruned at a higher cost of a verified row (the default on a CPU is 0.02), and
    # every branch verified in full (the default elsewhere)
    Config("d2sd-adaptive-K2", "d2sd", "target", {"k": _d2sd_k(2), "row_cost": 0.06, "redraft_min": 0}),
    Config("d2sd-full-K2", "d2sd", "target", {"k": _d2sd_k(2), "row_cost": None, "redraft_min": 0}),
    Config("d2sd-nolookup-K2", "d2sd", "target", {"k": _d2sd_k(2), "lookup": None, "redraft_min": 0}),
    # the first draft verified as a chain, the branches merged onto it (on a CPU, greedy,
    # `d2sd` grafts them onto DFlash's 7-node draft tree: tree="auto")
    Config("d2sd-chain-K2", "d2sd", "target", {"k": _d2sd_k(2), "tree": None, "redraft_min": 0}),
    # the paper's D2SD against the paper's DFlash (`dflash-chain`): the first draft a chain,
    # the K re-drafted branches merged onto it, no prompt-lookup branch
    Config(
        "d2sd-chain-nolookup-K2", "d2sd", "target", {"k": _d2sd_k(2), "tree": None, "lookup": None, "redraft_min": 0}
    ),
    # the method's defaults: on a CPU the re-draft gate (redraft_min="auto") never re-drafts,
    # so every cycle is DFlash's (measured: no gate pays on this CPU, cpu_cost.CPU_REDRAFT_MIN)
    Config("d2sd-auto", "d2sd", "target", {}),
    # the naive control: DFlash with K branches resampled from the first draft
    *(Config(f"d2sd-resample-K{k}", "d2sd", "target", {"k": _d2sd_k(k), "branches": "resample"}) for k in (1, 2, 4)),
)
BASELINE_AR = "ar"
BASELINE_DYNAMIC = "diffusion-dynamic"


# --------------------------------------------------------------------------- helpers
def _prompt_text(chat: bool, pset: str, problem) -> str:
    """A problem's prompt as the grid sends it: chat-wrapped on a chat model for the sets
    whose prompts are instructions (CHAT_SETS)."""
    from .models.embedded import chat_prompt

    return chat_prompt(problem.prompt) if chat and pset in CHAT_SETS else problem.prompt


def _git(*cmd) -> str | None:
    if not (REPO_ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_name(device: str) -> str:
    """The GPU's name, or the CPU model (shared with bench/common.py)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return cpu_model()


def device_slug(device: str) -> str:
    """The results folder of a device: "cpu", or the GPU's short name ("h100", ...)."""
    if not device.startswith("cuda"):
        return "cpu"
    name = device_name(device).lower()
    for tag in ("h200", "h100", "h20", "b200", "gb200", "a100", "a10g", "l40s", "l4", "4090"):
        if tag in name:
            return tag
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def environment(device: str) -> dict:
    """Machine, software and checkout record of a run."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    env = {
        "device": device,
        "device_name": device_name(device),
        "device_slug": device_slug(device),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "loadavg_start": loadavg(),
    }
    if not device.startswith("cuda"):
        from .cpu import machine

        env["cpu"] = machine()
    try:
        import dspec

        env["dspec"] = dspec.__version__
    except Exception:  # noqa: BLE001 - recorded, not fatal
        pass
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            gpu_mem_GiB=round(props.total_memory / 2**30, 1),
            torch_cuda=torch.version.cuda,
        )
    return env


def default_out_dir(device: str) -> Path:
    """``./dspec-bench/<device>``: results never land inside the installed package or the
    source tree unless ``--out`` says so (the repository's committed results use
    ``--out bench/results/cpu``)."""
    return Path.cwd() / "dspec-bench" / device_slug(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_config_spec(spec: str) -> Config:
    """``NAME=METHOD[@target|@dllm][:key=value,key=value]`` -> Config (``--add-config``)."""

    name, sep, rest = spec.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"--add-config expects NAME=METHOD[@target|@dllm][:key=value,...], got {spec!r}")
    head, _, opts = rest.partition(":")
    method, _, family = head.partition("@")
    from .decode.generate import ALL_METHODS

    method = method.strip()
    if method not in ALL_METHODS:
        raise ValueError(f"--add-config {spec!r}: unknown method {method!r}; methods: {list(ALL_METHODS)}")
    family = family.strip() or ("target" if method in ("ar", "diffuspec", "dflash", "d2sd") else "dllm")
    if family not in FAMILIES:
        raise ValueError(f"--add-config {spec!r}: family must be one of {FAMILIES}, got {family!r}")
    options = {}
    for pair in filter(None, (p.strip() for p in opts.split(","))):
        k, eq, v = pair.partition("=")
        if not eq or not k.strip().replace("-", "_").isidentifier():
            raise ValueError(f"--add-config {spec!r}: option {pair!r} is not key=value")
        options[k.strip().replace("-", "_")] = parse_value(v)
    return Config(name.strip(), method, family, options)


def resolve(config: Config) -> tuple[list[tuple[Config, dict]], str | None]:
    """The runnable variants of ``config`` with their concrete options, or a skip reason."""
    from .decode.generate import available_methods, method_module

    if config.method not in available_methods():
        return [], f"method {config.method!r} is not implemented yet (available: {list(available_methods())})"
    module = method_module(config.method)
    declared = tuple(getattr(module, "OPTIONS", ()))
    options = {}
    for key, value in config.options.items():
        if isinstance(value, Option):
            name = next((n for n in value.names if n in declared), None)
            if name is None:
                return [], (
                    f"method {config.method!r} takes none of the options {list(value.names)} "
                    f"(it takes {list(declared)})"
                )
            options[name] = value.value
        else:
            options[key] = value
    if config.expand == "policies":
        policies = tuple(getattr(module, "POLICIES", ()))
        key = next((n for n in ("policy", "routing", "router") if n in declared), None)
        if policies and key is not None:
            return [
                (Config(f"{config.name}-{p}", config.method, config.family, dict(options)), dict(options, **{key: p}))
                for p in policies
            ], None
    return [(config, options)], None


# --------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The bench's arguments (shared by ``python -m dspec bench`` and bench/bench_e2e.py)."""
    p.epilog = (p.epilog or "") + (
        "configurations (--configs): "
        + ", ".join(c.name for c in CONFIGS)
        + "\n(s2d2 expands to s2d2-<policy> for every policy its module lists in POLICIES)\n"
        "example:\n  python -m dspec bench --dllm tiny-bd --target tiny-ar --quick"
    )
    p.add_argument(
        "--dllm",
        default="tiny-bd",
        metavar="NAME|DIR",
        help="block-diffusion model for diffusion / ssd / spiffy / s2d2 (default tiny-bd)",
    )
    p.add_argument(
        "--target",
        default="tiny-ar",
        metavar="NAME|DIR",
        help="autoregressive target for ar / diffuspec / dflash / d2sd (default tiny-ar)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME|DIR", help="one model for both families (overrides --dllm and --target)"
    )
    p.add_argument(
        "--drafter",
        default=None,
        metavar="NAME|DIR",
        help="drafter for the methods that take one (default: the shipped one)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated configuration names (default: all); a method name selects all its configurations",
    )
    p.add_argument(
        "--add-config",
        action="append",
        default=[],
        metavar="SPEC",
        help="extra configuration NAME=METHOD[@target|@dllm][:key=value,...], "
        "e.g. 'bd-thr0.7=diffusion:threshold=0.7' (repeatable)",
    )
    p.add_argument("--list-configs", action="store_true", help="print the configurations and exit")
    p.add_argument(
        "--prompt-sets",
        default=",".join(PROMPT_SETS),
        help=f"comma-separated prompt sets (default {','.join(PROMPT_SETS)})",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per set (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call (default 1: one at a time)")
    p.add_argument("--temperature", type=float, default=0.0, help="<= 0: greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weight dtype (default: dspec.load's, bf16 on CPUs with native bf16 matmul, else float32; $DSPEC_DTYPE)",
    )
    add_threads_argument(p)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 prompts per set, 16 new tokens")
    p.add_argument("--out", default=None, help="output directory (default bench/results/<device>/)")
    p.add_argument("--name", default=NAME, help=f"file stem of the JSON / PNG (default {NAME})")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# seeds: each timed call adds its prompt offset to --seed, and torch's generators take < 2**64
MAX_SEED = 2**63 - 1


def _check_global_flags(args, parser) -> None:
    """The flags every configuration shares, checked before anything runs: a value no
    configuration could run with is an argparse error (exit 2), never a grid of skips."""
    for flag in ("prompts", "max_new_tokens", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not math.isfinite(args.temperature):
        parser.error(f"--temperature must be a finite number (<= 0: greedy), got {args.temperature}")
    if not 0 <= args.seed <= MAX_SEED:
        parser.error(f"--seed must lie in [0, 2**63 - 1], got {args.seed}")
    try:
        torch.device(args.device)
    except (RuntimeError, TypeError, ValueError):
        parser.error(f"--device must be a torch device such as cpu or cuda, got {args.device!r}")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file, not a directory")
    if args.drafter is not None:
        from .hub import available_models
        from .models.dflash import ASSETS

        models = available_models()
        for part in args.drafter.split(","):
            if not part.strip():
                parser.error(f"--drafter {args.drafter!r}: an empty name")
            if not (Path(part).expanduser().is_dir() or part in models or (ASSETS / part).is_dir()):
                drafters = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
                parser.error(
                    f"--drafter {part!r} is neither a directory, a shipped model ({models}) nor a "
                    f"shipped drafter ({drafters})"
                )


def _check_args(args, parser) -> tuple[list[Config], list[str]]:
    _check_global_flags(args, parser)
    if args.quick:
        args.prompts, args.max_new_tokens = min(args.prompts, 2), 16
    if args.model:
        args.dllm = args.target = args.model
    sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
    bad = [s for s in sets if s not in PROMPT_SETS]
    if bad or not sets:
        parser.error(f"--prompt-sets: unknown {bad}; available: {list(PROMPT_SETS)}")
    try:
        extra = [parse_config_spec(s) for s in args.add_config]
    except ValueError as e:
        parser.error(str(e))
    configs = list(CONFIGS) + extra
    args._wanted = None
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        # a name (that configuration alone), a method that is no configuration's name (every
        # configuration of it), or a policy variant "s2d2-<policy>" of an expanding configuration
        config_names = {c.name for c in configs}

        def selected(c, w):
            return (
                w == c.name
                or (w not in config_names and w == c.method)
                or (c.expand is not None and w.startswith(c.name + "-"))
            )

        unknown = [w for w in wanted if not any(selected(c, w) for c in configs)]
        if unknown:
            parser.error(f"--configs: unknown {unknown}; known: {[c.name for c in configs]}")
        configs = [c for c in configs if c in extra or any(selected(c, w) for w in wanted)]
        args._wanted = wanted
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        parser.error(f"configuration names must be unique, got {names}")
    return configs, sets


# --------------------------------------------------------------------------- the run
def _prompts(sets: list[str], n: int, seed: int) -> tuple[dict, dict]:
    from . import tasks

    out, skipped = {}, {}
    for s in sets:
        try:
            items = tasks.prompt_set(s, n, seed=seed) if s == "arithmetic" else tasks.prompt_set(s, n)
        except ValueError as e:
            skipped[s] = str(e)
            continue
        if items:
            out[s] = items
    return out, skipped


def _wall_split(stats: dict) -> dict:
    split = {}
    for k, v in stats.items():
        if (
            k.endswith("_s")
            and k not in ("wall_s", "tokens_per_s")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        ):
            split[k] = float(v)
    return split


def summarize(config: str, method: str, family: str, model_name: str, pset: str, calls: list[dict]) -> dict:
    """One summary row of the grid from its call rows."""
    new = sum(c["new_tokens"] for c in calls)
    wall = sum(c["wall_s"] for c in calls)
    nfe: dict[str, int] = {}
    request_forwards: dict[str, int] = {}  # forwards x requests in the call, per role
    for c in calls:
        for k, v in c["nfe"].items():
            nfe[k] = nfe.get(k, 0) + int(v)
            request_forwards[k] = request_forwards.get(k, 0) + int(v) * c["requests"]
    weighted = [(c["mean_accepted"], c["new_tokens"]) for c in calls if c["mean_accepted"] is not None]
    weight = sum(w for _, w in weighted)
    split: dict[str, float] = {}
    for c in calls:
        for k, v in c["wall_split_s"].items():
            split[k] = split.get(k, 0.0) + v
    checked = [ok for c in calls for ok in c["correct"] if ok is not None]
    per_call = sorted(c["tokens_per_s"] for c in calls)
    return {
        "kind": "summary",
        "config": config,
        "method": method,
        "family": family,
        "model": model_name,
        "prompt_set": pset,
        "calls": len(calls),
        "requests": sum(c["requests"] for c in calls),
        "new_tokens": new,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(new / wall, 3) if wall > 0 else None,
        "tokens_per_s_call_median": round(statistics.median(per_call), 3),
        "nfe": nfe,
        "nfe_target": nfe.get("target", 0),
        "nfe_drafter": nfe.get("drafter", 0),
        "tokens_per_target_forward": (
            round(new / request_forwards["target"], 4) if request_forwards.get("target") else None
        ),
        "forwards_per_token": {k: round(v / new, 4) for k, v in request_forwards.items()} if new else None,
        "mean_accepted": round(sum(a * w for a, w in weighted) / weight, 4) if weight else None,
        "accuracy": round(sum(checked) / len(checked), 4) if checked else None,
        "checked": len(checked),
        "wall_split_s": {k: round(v, 4) for k, v in split.items()} or None,
        "loadavg_end": loadavg(),
    }


def add_speedups(summaries: list[dict]) -> None:
    """speedup_vs_ar / speedup_vs_dynamic from the baseline rows of the same prompt set."""
    base = {(s["config"], s["prompt_set"]): s for s in summaries}
    for s in summaries:
        ar = base.get((BASELINE_AR, s["prompt_set"]))
        dyn = base.get((BASELINE_DYNAMIC, s["prompt_set"]))
        s["speedup_vs_ar"] = (
            round(s["tokens_per_s"] / ar["tokens_per_s"], 3)
            if ar and ar["tokens_per_s"] and s["tokens_per_s"]
            else None
        )
        s["speedup_vs_dynamic"] = (
            round(s["tokens_per_s"] / dyn["tokens_per_s"], 3)
            if s["family"] == "dllm" and dyn and dyn["tokens_per_s"] and s["tokens_per_s"]
            else None
        )


# the configuration whose output a lossless method must reproduce (greedy, same prompts)
LOSSLESS_REFERENCE = {
    "ssd": "diffusion-static-1",
    "spiffy": "diffusion-static-1",
    "dflash": BASELINE_AR,
    "d2sd": BASELINE_AR,
    "diffuspec": BASELINE_AR,
}


# the s2d2 configurations that verify every span (policy "always"): lossless against ``ar``
# when the dLLM's block-size-1 mode is the target
S2D2_LOSSLESS = ("s2d2-always", "s2d2-boundary")


def add_lossless_checks(summaries: list[dict], calls: list[dict], temperature: float) -> None:
    """``same_as_reference``: the share of prompts whose completion text equals that of the
    lossless method's reference configuration (greedy runs only: sampled outputs differ by
    design), with ``reference`` naming it.  ``s2d2-always`` and ``s2d2-boundary`` are compared
    with ``ar`` too: equal when the dLLM's block-size-1 mode is the target (a mask-selective
    adapter)."""
    if temperature > 0:
        return
    texts: dict = {}
    for c in calls:
        for tid, text in zip(c["task_ids"], c.get("texts", [])):
            texts[(c["config"], c["prompt_set"], tid)] = text
    for s in summaries:
        ref = LOSSLESS_REFERENCE.get(s["method"]) or (BASELINE_AR if s["config"] in S2D2_LOSSLESS else None)
        if ref is None:
            continue
        pairs = [
            (t, texts.get((ref, s["prompt_set"], k[2])))
            for k, t in texts.items()
            if k[0] == s["config"] and k[1] == s["prompt_set"]
        ]
        pairs = [(a, b) for a, b in pairs if b is not None]
        if pairs:
            s["reference"] = ref
            s["same_as_reference"] = round(sum(a == b for a, b in pairs) / len(pairs), 4)


def drafter_kind(method: str):
    """What ``method`` takes as ``drafter=``: False, "model" (a dLLM) or "block" (DFlash / VP)."""
    from .decode.generate import method_module

    return getattr(method_module(method), "DRAFTER", False)


def _load_drafter(spec: str, method: str, model, device, dtype, loaded: dict):
    """``--drafter`` for ``method``, each drafter loaded once (outside every timed call) and
    kept in ``loaded``: a dLLM through ``dspec.load`` for ``diffuspec``, a block drafter
    (``DFLASH[,VP]`` for ``d2sd``) for ``dflash`` / ``d2sd``; ValueError when it is not one."""

    def once(key, make):
        if key not in loaded:
            loaded[key] = make()
        return loaded[key]

    if drafter_kind(method) == "model":
        from . import load

        return once(("model", spec), lambda: load(spec, device=device, dtype=dtype))
    from .models.dflash import resolve_drafter

    parts = spec.split(",")
    if len(parts) > 2 or (len(parts) == 2 and method != "d2sd"):
        raise ValueError(f"DFLASH,VP names two drafters, for d2sd only; {method} takes one")
    first = once(("dflash", parts[0]), lambda: resolve_drafter(parts[0], model, "dflash"))
    if len(parts) == 1:
        return first
    return {"dflash": first, "vp": once(("vp", parts[1]), lambda: resolve_drafter(parts[1], model, "vp"))}


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def run(args, parser: argparse.ArgumentParser) -> int:
    """Run the grid described by ``args`` (see :func:`add_arguments`); returns an exit code."""
    import dspec

    from .cpu import apply_threads
    from .tasks import check_arithmetic, check_math

    checkers = {"arithmetic": check_arithmetic, "math500": check_math}

    configs, sets = _check_args(args, parser)
    if args.list_configs:
        for c in configs:
            variants, why = resolve(c)
            opts = {k: (v.value if isinstance(v, Option) else v) for k, v in c.options.items()}
            state = why or ", ".join(v.name for v, _ in variants)
            print(f"{c.name:24s} {c.method:10s} on {c.family:6s} {opts}  [{state}]")
        return 0
    try:
        apply_threads(args.threads)
    except ValueError as e:
        parser.error(f"--threads: {e}")
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    torch.manual_seed(args.seed)
    out_dir = Path(args.out) if args.out else default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"

    payload = {
        "bench_e2e": 1,
        "env": environment(device),
        "config": {
            "dllm": args.dllm,
            "target": args.target,
            "drafter": args.drafter,
            "prompt_sets": sets,
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "batch": args.batch,
            "temperature": args.temperature,
            "seed": args.seed,
            "dtype": args.dtype,
            "chat_wrapped_sets": list(CHAT_SETS),
            "warmup_calls_per_config": 1,
            "tokens": "completion only (prompt excluded), up to and including EOS",
            "wall": "whole generate() call incl. tokenisation and prefill",
        },
        "models": {},
        "configs": [],
        "skipped": {},
        "skipped_prompt_sets": {},
        "errors": [],
        "summary": [],
        "calls": [],
        "complete": False,
    }
    prompts, payload["skipped_prompt_sets"] = _prompts(sets, args.prompts, args.seed)

    # resolve configurations against the implemented methods
    runnable: list[tuple[Config, dict]] = []
    for c in configs:
        variants, why = resolve(c)
        if why:
            payload["skipped"][c.name] = why
        if (
            args._wanted and c.expand is not None and c.name not in args._wanted and c.method not in args._wanted
        ):  # only the policy variants asked for
            variants = [(v, o) for v, o in variants if v.name in args._wanted]
        runnable += variants

    # load the models the runnable configurations need, once each
    models = {}
    names = {"target": args.target, "dllm": args.dllm}
    for family in FAMILIES:
        if not any(c.family == family for c, _ in runnable):
            continue
        name = names[family]
        same = [f for f in models if names[f] == name]
        if same:
            models[family] = models[same[0]]
            payload["models"][family] = payload["models"][same[0]]
            continue
        t0 = time.perf_counter()
        try:
            models[family] = dspec.load(name, device=device, dtype=args.dtype)
        except ValueError as e:
            models[family] = e
            payload["models"][family] = {"name": name, "error": str(e)}
            continue
        m = models[family]
        payload["models"][family] = {
            "name": name,
            "family": m.family,
            "attention": m.attention,
            "shifted": m.shifted,
            "block_size": m.block_size,
            "dtype": str(m.dtype).replace("torch.", ""),
            "parameters": sum(p.numel() for p in m.parameters()),
            "chat": is_chat_model(m),
            "load_s": round(time.perf_counter() - t0, 2),
        }

    todo = []
    for c, opts in runnable:
        model = models.get(c.family)
        if isinstance(model, Exception):
            payload["skipped"][c.name] = f"{c.family} model {names[c.family]!r} did not load: {model}"
            continue
        todo.append((c, opts, model))
    payload["configs"] = [
        {"name": c.name, "method": c.method, "family": c.family, "model": names[c.family], "options": json_safe(o)}
        for c, o, _ in todo
    ]
    _write(path, payload)

    drafters = {}
    calls_per_config = sum(-(-len(v) // args.batch) for v in prompts.values())
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo) * calls_per_config, desc="bench", unit="call", disable=args.no_progress)
    summaries = payload["summary"]
    # Warm up every configuration first (excluded from every number); the timed calls then go
    # round robin -- every configuration on a prompt before any on the next -- so that
    # phases of the machine's speed (a VM's memory bandwidth drifts by tens of percent within
    # minutes) land on all configurations alike, not on whole configurations.
    active = []
    first_set = next(iter(prompts), None)
    for c, opts, model in todo:
        kw = dict(method=c.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, **opts)
        if args.drafter and drafter_kind(c.method):
            try:
                kw["drafter"] = _load_drafter(args.drafter, c.method, model, device, args.dtype, drafters)
            except ValueError as e:
                payload["skipped"][c.name] = f"--drafter {args.drafter}: {e}"
                bar.update(calls_per_config)
                _write(path, payload)
                continue
        if first_set is None:
            break
        chat = is_chat_model(model)
        bar.set_description(f"warm-up {c.name}")
        try:
            dspec.generate(model, _prompt_text(chat, first_set, prompts[first_set][0]), seed=args.seed, **kw)
            _sync(device)
        except ValueError as e:
            payload["skipped"][c.name] = f"{c.family} model {names[c.family]!r} cannot run it: {e}"
            bar.update(calls_per_config)
            _write(path, payload)
            continue
        except Exception as e:  # noqa: BLE001 - one failing configuration must not stop the grid
            payload["errors"].append(f"{c.name} warm-up: {type(e).__name__}: {e}")
            bar.update(calls_per_config)
            _write(path, payload)
            continue
        active.append((c, model, kw, chat))
    bar.set_description("bench")
    calls_of = {(c.name, pset): [] for c, _, _, _ in active for pset in prompts}
    for pset, problems in prompts.items():
        for ci in range(0, len(problems), args.batch):
            chunk = problems[ci : ci + args.batch]
            for c, model, kw, chat in active:
                texts = [_prompt_text(chat, pset, p) for p in chunk]
                try:
                    _sync(device)
                    t0 = time.perf_counter()
                    gens = dspec.generate(model, texts if args.batch > 1 else texts[0], seed=args.seed + ci, **kw)
                    _sync(device)
                    wall = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001
                    payload["errors"].append(f"{c.name} {pset} call {ci}: {type(e).__name__}: {e}")
                    bar.update(1)
                    continue
                gens = gens if isinstance(gens, list) else [gens]
                new = sum(len(g.tokens) for g in gens)
                stats = gens[0].stats
                correct = [checkers[pset](p, g.text) if pset in checkers else None for p, g in zip(chunk, gens)]
                row = {
                    "kind": "call",
                    "config": c.name,
                    "prompt_set": pset,
                    "call": ci // args.batch,
                    "task_ids": [p.task_id for p in chunk],
                    "requests": len(chunk),
                    "new_tokens": new,
                    "new_tokens_each": [len(g.tokens) for g in gens],
                    "wall_s": round(wall, 5),
                    "tokens_per_s": round(new / wall, 3) if wall > 0 else None,
                    "nfe": {k: int(v) for k, v in stats.get("nfe", {}).items()},
                    "mean_accepted": stats.get("mean_accepted"),
                    "correct": correct,
                    "wall_split_s": _wall_split(stats),
                    "stats": json_safe({k: v for k, v in stats.items() if k not in ("wall_s", "tokens_per_s", "nfe")}),
                    "texts": [g.text for g in gens],
                }
                calls_of[(c.name, pset)].append(row)
                payload["calls"].append(row)
                bar.update(1)
                bar.set_postfix(cfg=c.name, set=pset, tok_s=f"{row['tokens_per_s'] or 0:.1f}")
        for c, _, _, _ in active:  # this prompt set is done for every configuration
            calls = calls_of[(c.name, pset)]
            if calls:
                summaries.append(summarize(c.name, c.method, c.family, names[c.family], pset, calls))
        add_speedups(summaries)
        _write(path, payload)
    # rows grouped by configuration, in the order they were given
    order = {c.name: i for i, (c, _, _) in enumerate(todo)}
    sets = {pset: i for i, pset in enumerate(prompts)}
    summaries.sort(key=lambda r: (order.get(r["config"], len(order)), sets.get(r["prompt_set"], len(sets))))
    bar.close()
    payload["env"]["loadavg_end"] = loadavg()
    # a grid where no configuration ran (every one skipped or failed) measured nothing
    payload["complete"] = bool(summaries)
    add_speedups(summaries)
    add_lossless_checks(summaries, payload["calls"], args.temperature)
    _write(path, payload)
    print(f"wrote {path}")
    if not args.no_plot and summaries:
        try:
            png = plot(payload, out_dir / f"{args.name}.png")
            print(f"wrote {png}")
        except Exception as e:  # noqa: BLE001 - a plot failure must not lose the JSON
            print(f"plot failed: {e!r}", file=sys.stderr)
    print(report(payload))
    if not summaries:
        print(
            f"error: no configuration ran ({len(payload['skipped'])} skipped, {len(payload['errors'])} "
            f"failed; the reasons are in {path})",
            file=sys.stderr,
        )
        return 1
    return 1 if payload["errors"] else 0


# --------------------------------------------------------------------------- output
COLUMNS = (
    "config",
    "prompt_set",
    "model",
    "requests",
    "new_tokens",
    "tokens_per_s",
    "speedup_vs_ar",
    "speedup_vs_dynamic",
    "nfe_target",
    "nfe_drafter",
    "tokens_per_target_forward",
    "mean_accepted",
    "accuracy",
    "same_as_reference",
)


def report(payload: dict) -> str:
    """The console summary: environment line, skipped configurations, one table."""
    env, cfg = payload["env"], payload["config"]
    lines = [
        f"{env['device_name']} ({env['device']}, {env['torch_threads']} torch threads, "
        f"{env['cpu_count']} CPUs, torch {env['torch']}, git {str(env['git_commit'])[:10]}"
        f"{' dirty' if env['git_dirty'] else ''}); loadavg start {env.get('loadavg_start')} "
        f"end {env.get('loadavg_end')}",
        f"dllm {cfg['dllm']}, target {cfg['target']}; {cfg['prompts_per_set']} prompts/set x <= "
        f"{cfg['max_new_tokens']} new tokens, batch {cfg['batch']}, T={cfg['temperature']}; "
        f"1 warm-up call per configuration excluded; completion tokens only",
    ]
    for name, why in payload["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    for name, why in payload.get("skipped_prompt_sets", {}).items():
        lines.append(f"skipped prompt set {name}: {why}")
    for e in payload["errors"]:
        lines.append(f"ERROR {e}")
    rows = payload["summary"]
    if rows:
        cells = [["" if r.get(k) is None else str(r.get(k)) for k in COLUMNS] for r in rows]
        widths = [max([len(k)] + [len(x[i]) for x in cells]) for i, k in enumerate(COLUMNS)]
        lines.append("  ".join(k.rjust(w) for k, w in zip(COLUMNS, widths)))
        lines += ["  ".join(x.rjust(w) for x, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> Path:
    """Three panels: tokens/s per configuration and prompt set; model forwards per completion
    token (target and drafter stacked); accuracy against tokens/s on the checkable set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["summary"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    by = {(r["config"], r["prompt_set"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    width = 0.8 / max(len(sets), 1)
    xs = range(len(configs))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, s in enumerate(sets):
        off = [x - 0.4 + width * (j + 0.5) for x in xs]
        tps = [by[(c, s)]["tokens_per_s"] if (c, s) in by else 0 for c in configs]
        axes[0].bar(off, tps, width, label=s, color=colors[j % len(colors)])
        fpt = [(by[(c, s)]["forwards_per_token"] or {}) if (c, s) in by else {} for c in configs]
        tgt = [f.get("target", 0) for f in fpt]
        drf = [sum(v for k, v in f.items() if k != "target") for f in fpt]
        axes[1].bar(off, tgt, width, color=colors[j % len(colors)], label=f"{s}: target")
        if any(drf):
            axes[1].bar(
                off, drf, width, bottom=tgt, color=colors[j % len(colors)], alpha=0.4, hatch="//", label=f"{s}: drafter"
            )
    for ax, ylabel, title in (
        (axes[0], "completion tokens / s", "throughput"),
        (axes[1], "forwards per completion token (per request)", "model forwards per token (lower is better)"),
    ):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(configs, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    acc = [r for r in rows if r.get("accuracy") is not None]
    ax = axes[2]
    for r in acc:
        ax.scatter(r["tokens_per_s"], r["accuracy"], s=25)
        ax.annotate(
            r["config"], (r["tokens_per_s"], r["accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_xlabel("completion tokens / s")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("accuracy vs speed (checkable set)" if acc else "no checkable prompt set", fontsize=10)
    ax.grid(True, alpha=0.3)
    env, cfg = payload["env"], payload["config"]
    fig.suptitle(
        f"dspec e2e: dllm {Path(str(cfg['dllm'])).name}, target {Path(str(cfg['target'])).name} "
        f"on {env['device_name']} "
        f"({env['torch_threads']} threads, loadavg {env.get('loadavg_start')}); "
        f"{cfg['prompts_per_set']} prompts/set x {cfg['max_new_tokens']} tok, batch "
        f"{cfg['batch']}, T={cfg['temperature']}, {env['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser(prog: str | None = "python -m dspec bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return add_arguments(p)


def main(argv=None, prog: str | None = "python -m dspec bench") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the grid; returns the exit status
    (user errors: one ``error:`` line and 2, Ctrl-C: 130; ``dspec._cli.run_command``)."""

    def _main():
        parser = build_parser(prog)
        return run(parser.parse_args(argv), parser)

    return run_command(_main)


if __name__ == "__main__":
    sys.exit(main())

"""Same-process A/B runs of decoding configurations on the e2e grid's prompts: one tool, one
subcommand per question.

This VM's memory bandwidth moves between processes, so a new artifact (a drafter round, an
adapter round) or a code path is judged against the one it replaces inside one run, the
configurations (*arms*) interleaved per prompt, greedy, batch 1 (``ab_common.py``: the loop,
the summary rows, the lossless checks against each arm's reference).

==========  ==================================================================================
adapters    mask-adapter rounds of one base: per adapter one-token ``diffusion``, ``ssd``,
            ``spiffy``, ``s2d2`` (``min_span``, ``always``) and ``diffuspec``, against ``ar``
            and against that adapter's own one-token diffusion
drafters    DFlash drafter rounds for one target: ``dflash`` (chain) and ``dflash-adaptive``
            per drafter; ``--vp-drafters`` adds D2SD's chain and tree settings per pair,
            ``--tree N[,M..]`` DFlash draft trees of N nodes, ``--verify-all`` every drafted
            node verified (``row_cost=None``: acceptance as the papers count it)
options     one method under several option sets (JSON objects), e.g. ``row_cost`` or draft
            lengths: tuning a CPU default by wall clock; each set must reproduce the first's
            output where the method is lossless
glue        the decode glue of the speculative cycles (trusted value checks, the compiled
            draft tree, the row commit, the drafter's fused context) on and off
selfspec    the compiled host-side rounds of ``ssd`` / ``spiffy`` / ``s2d2`` against the torch
            compositions they replaced
diffuspec   DiffuSpec's drafting changes (the draft vocabulary, the shared KV cache) on and off
mask-lora   the mask adapter's update on AMX tiles against the AVX-512 code (a second copy of
            the model whose adapted projections offer no packed adapter)
==========  ==================================================================================

    python bench/ab.py adapters --adapters smollm2-135m-bd,runs/bd-r5/adapter --prompts 8
    python bench/ab.py drafters --drafters smollm2-135m-dflash --vp-drafters smollm2-135m-vp,runs/vp-r4/drafter
    python bench/ab.py options --method diffuspec --options '{}' '{"k_min": 4, "k_max": 12}' --prompts 4
    python bench/ab.py glue --prompts 8
    python bench/ab.py selfspec --methods s2d2 --prompts 8 --name ab_s2d2_native

Writes bench/results/cpu/<name>.json (default name: ``ab_<subcommand>``; ``options``:
``ab_<method>``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import Arm, add_run_arguments, grid_texts, option_sets, run_interleaved, summary_rows
from common import environment, write_json

# ----------------------------------------------------------------------------- adapters


def adapters_arguments(ap) -> None:
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--adapters", required=True, help="comma-separated adapted names or adapter directories")
    add_run_arguments(ap, prompts=8, name="ab_adapters")


def adapters_arms(args, ap):
    from dspec.hub import ADAPTED
    from dspec.train.mask_adapter import load_mask_adapter

    base = dspec.load(args.base)
    arms = [Arm("ar", base, "ar")]
    vs_diffusion = {}
    for name in args.adapters.split(","):
        # a shipped adapted model by name, or an adapter directory on a fresh copy of the base
        bd = dspec.load(name) if name in ADAPTED else load_mask_adapter(dspec.load(args.base), name)
        ref = f"diffusion[{name}]"
        arms += [
            Arm(ref, bd, "diffusion", {"tokens_per_step": 1}),
            Arm(f"ssd[{name}]", bd, "ssd", reference=ref),
            Arm(f"spiffy[{name}]", bd, "spiffy", reference=ref),
            Arm(f"s2d2-min_span[{name}]", bd, "s2d2", {"policy": "min_span"}),
            Arm(f"s2d2-always[{name}]", bd, "s2d2", {"policy": "always"}, reference="ar"),
            Arm(f"diffuspec[{name}]", base, "diffuspec", {"drafter": bd}, reference="ar"),
        ]
        vs_diffusion.update({a.name: ref for a in arms[-6:]})
    return arms, base, {"ar": "ar", "diffusion": vs_diffusion}


# ----------------------------------------------------------------------------- drafters


def drafters_arguments(ap) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", required=True, help="comma-separated drafter names or directories")
    ap.add_argument(
        "--vp-drafters",
        default=None,
        help="comma-separated VP drafters, one per --drafters entry (or any number with one "
        "DFlash drafter): adds the d2sd-chain and d2sd-tree arms per pair",
    )
    ap.add_argument("--row-cost", type=float, default=0.06, help="dflash-adaptive's row_cost")
    ap.add_argument(
        "--tree",
        default=None,
        help="comma-separated node counts: a dflash arm per drafter and count verifying a draft tree",
    )
    ap.add_argument(
        "--verify-all",
        action="store_true",
        help="dflash / dflash-tree / d2sd arms verify every drafted node (row_cost=None)",
    )
    ap.add_argument(
        "--d2sd-variants",
        nargs="*",
        default=[],
        metavar="JSON",
        help="per DFlash / VP pair, one more d2sd-chain arm per JSON dict of d2sd options, e.g. "
        "'{\"boundary_pool\": 4}' '{\"prior_weight\": 1.0}'",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated arm-name prefixes to run (ar always runs), e.g. 'dflash[,d2sd-chain'",
    )
    add_run_arguments(ap, prompts=32, name="ab_drafters")


def drafters_arms(args, ap):
    from dspec.models.dflash import resolve_drafter

    model = dspec.load(args.target)
    paths = args.drafters.split(",")
    vp_names = args.vp_drafters.split(",") if args.vp_drafters else []
    if len(paths) == 1:
        vps = [vp_names]  # every VP drafter against the one DFlash drafter
    elif not vp_names or len(vp_names) == len(paths):
        vps = [[v] for v in vp_names] or [[] for _ in paths]
    else:
        ap.error(f"--vp-drafters: one per --drafters entry ({len(paths)}) or any number with one, got {len(vp_names)}")
    try:
        trees = [int(n) for n in args.tree.split(",")] if args.tree else []
    except ValueError:
        ap.error(f"--tree: comma-separated ints, got {args.tree!r}")
    variants = option_sets(ap, "--d2sd-variants", args.d2sd_variants)
    full = {"row_cost": None} if args.verify_all else {}
    chain = {"k": 2, "tree": None, "lookup": None, "redraft_min": 0, **full}  # D2SD as published
    arms = [Arm("ar", model, "ar")]
    for path, vp_list in zip(paths, vps):
        d = resolve_drafter(path, model, "dflash")
        arms += [
            Arm(f"dflash[{path}]", model, "dflash", {"drafter": d, "tree": None, **full}, reference="ar"),
            Arm(
                f"adaptive[{path}]",
                model,
                "dflash",
                {"drafter": d, "row_cost": args.row_cost, "tree": None},
                reference="ar",
            ),
        ]
        for nodes in trees:
            arms.append(Arm(f"tree{nodes}[{path}]", model, "dflash", {"drafter": d, "tree": nodes}, reference="ar"))
        if vp_list:
            arms.append(Arm(f"dflash-tree[{path}]", model, "dflash", {"drafter": d, **full}, reference="ar"))
        for vp in vp_list:
            pair = {"dflash": d, "vp": resolve_drafter(vp, model, "vp")}
            arms += [
                Arm(f"d2sd-chain[{path},{vp}]", model, "d2sd", {"drafter": pair, **chain}, reference="ar"),
                Arm(
                    f"d2sd-tree[{path},{vp}]",
                    model,
                    "d2sd",
                    {"drafter": pair, "k": 2, "redraft_min": 0, **full},
                    reference="ar",
                ),
            ]
            for extra in variants:
                label = ",".join(f"{key}={val}" for key, val in extra.items())
                options = {"drafter": pair, **chain, **extra}
                arms.append(Arm(f"d2sd-chain{{{label}}}[{path},{vp}]", model, "d2sd", options, reference="ar"))
    if args.only:
        prefixes = tuple(args.only.split(","))
        arms = [a for a in arms if a.name == "ar" or a.name.startswith(prefixes)]
    return arms, model, {"ar": "ar"}


# ----------------------------------------------------------------------------- options


def options_arguments(ap) -> None:
    ap.add_argument("--model", default="smollm2-135m", help="shipped name or checkpoint directory")
    ap.add_argument("--method", required=True)
    ap.add_argument(
        "--options",
        nargs="+",
        required=True,
        metavar="JSON",
        help="option sets as JSON objects, e.g. '{}' '{\"row_cost\": 0.02}'",
    )
    ap.add_argument(
        "--others",
        default="",
        metavar="METHODS",
        help="comma-separated methods decoded beside, with their defaults (e.g. dflash next to d2sd)",
    )
    add_run_arguments(ap, prompts=8, name=None)  # default name: ab_<method>


def options_arms(args, ap):
    sets = option_sets(ap, "--options", args.options)
    args.name = args.name or f"ab_{args.method}"
    model = dspec.load(args.model)
    # the baseline: ar on a causal model, one-token diffusion on a dLLM
    base, base_options = ("ar", {}) if model.attention == "causal" else ("diffusion", {"tokens_per_step": 1})
    arms = [Arm(base, model, base, base_options)]
    for other in filter(None, args.others.split(",")):
        arms.append(Arm(other, model, other, {}, reference=base if base == "ar" else None))
    first = None
    for opts in sets:
        name = f"{args.method}{json.dumps(opts, sort_keys=True)}"
        arms.append(Arm(name, model, args.method, opts, reference=first))
        first = first or name
    return arms, model, {base: base}


# ----------------------------------------------------------------------------- glue


@contextlib.contextmanager
def glue_off():
    """The decode glue off: value checks on in decode loops, the torch composition of the
    draft tree, the index commit of KV rows, the per-op context K / V of the drafter."""
    import dspec.decode.dflash as dflash_mod
    import dspec.models.kv_cache as kv_cache_mod
    from dspec import _validate
    from dspec.models.dflash import BlockDrafter

    saved = (
        _validate.config.trust_decode,
        dflash_mod._backend,
        kv_cache_mod._commit_rows_cpu,
        BlockDrafter._context_kv_fused,
    )
    _validate.config.trust_decode = False
    dflash_mod._backend = SimpleNamespace(extension=lambda: None)
    kv_cache_mod._commit_rows_cpu = lambda *args: False
    BlockDrafter._context_kv_fused = lambda self, *args: None
    try:
        yield
    finally:
        (
            _validate.config.trust_decode,
            dflash_mod._backend,
            kv_cache_mod._commit_rows_cpu,
            BlockDrafter._context_kv_fused,
        ) = saved


def glue_arguments(ap) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", default="dflash,d2sd", help="comma-separated methods on the target")
    add_run_arguments(ap, prompts=8, name="ab_glue")


def glue_arms(args, ap):
    model = dspec.load(args.target)
    arms = [Arm("ar", model, "ar")]
    for method in args.methods.split(","):
        arms += [
            Arm(f"{method}[glue off]", model, method, reference="ar", scope=glue_off),
            Arm(method, model, method, reference="ar"),
        ]
    glue_off_of = {a.name: f"{a.name}[glue off]" for a in arms if "[" not in a.name and a.name != "ar"}
    return arms, model, {"ar": "ar", "glue_off": glue_off_of}


# ----------------------------------------------------------------------------- selfspec

SELFSPEC_REFERENCE = {"ssd": "diffusion-static-1", "spiffy": "diffusion-static-1", "s2d2": "ar"}


@contextlib.contextmanager
def compiled_round_off():
    """The torch compositions instead of the compiled self-speculative rounds / steps."""
    from dspec.decode import s2d2, selfspec

    init, native = selfspec.SelfSpecEngine.__init__, s2d2.native_extension

    def torch_round(self, *args, **kw):
        init(self, *args, **kw)
        self.native = None

    selfspec.SelfSpecEngine.__init__ = torch_round
    s2d2.native_extension = lambda *a: None
    try:
        yield
    finally:
        selfspec.SelfSpecEngine.__init__ = init
        s2d2.native_extension = native


def selfspec_arguments(ap) -> None:
    ap.add_argument("--model", default="smollm2-135m-bd")
    ap.add_argument("--target", default="smollm2-135m", help="the AR model s2d2's output must equal")
    ap.add_argument("--methods", default="ssd,spiffy", help="comma-separated: ssd, spiffy, s2d2")
    add_run_arguments(ap, prompts=8, name="ab_selfspec")


def selfspec_arms(args, ap):
    refs = SELFSPEC_REFERENCE
    methods = args.methods.split(",")
    if any(m not in refs for m in methods):
        ap.error(f"--methods: each one of {sorted(refs)}")
    model = dspec.load(args.model)
    arms = []
    if any(refs[m] == "diffusion-static-1" for m in methods):
        arms.append(Arm("diffusion-static-1", model, "diffusion", {"tokens_per_step": 1}))
    if "s2d2" in methods:
        arms.append(Arm("ar", dspec.load(args.target), "ar"))
    for method in methods:
        options = {"policy": "always"} if method == "s2d2" else {}
        arms += [
            Arm(f"{method}[torch round]", model, method, options, reference=refs[method], scope=compiled_round_off),
            Arm(method, model, method, options, reference=refs[method]),
        ]
    torch_of = {a.name: f"{a.name}[torch round]" for a in arms if a.name in refs}
    return arms, model, {"reference": {m: refs[m] for m in methods}, "torch_round": torch_of}


# ----------------------------------------------------------------------------- diffuspec


@contextlib.contextmanager
def own_cache():
    """DiffuSpec's drafter keeps its own KV cache (re-forwards its pending tokens, commits them)."""
    from dspec.decode import diffuspec

    saved = diffuspec.shares_target_cache
    diffuspec.shares_target_cache = lambda model, drafter: False
    try:
        yield
    finally:
        diffuspec.shares_target_cache = saved


def diffuspec_arguments(ap) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    add_run_arguments(ap, prompts=8, name="ab_diffuspec")


def diffuspec_arms(args, ap):
    model = dspec.load(args.target)
    before = "diffuspec[full vocab, own cache]"  # the path before both changes
    arms = [
        Arm("ar", model, "ar"),
        Arm(before, model, "diffuspec", {"draft_vocab": None}, reference="ar", scope=own_cache),
        Arm("diffuspec[own cache]", model, "diffuspec", reference="ar", scope=own_cache),
        Arm("diffuspec", model, "diffuspec", reference="ar"),
    ]
    return arms, model, {"ar": "ar", "before": {a.name: before for a in arms[2:]}}


# ----------------------------------------------------------------------------- mask-lora

MASK_LORA_CONFIGS = (
    ("diffusion-static-1", "diffusion", {"tokens_per_step": 1}),
    ("ssd", "ssd", {}),
    ("ssd-d2", "ssd", {"draft_len": 2, "mixed_order": False}),
    ("s2d2-always", "s2d2", {"policy": "always"}),
)


def mask_lora_arguments(ap) -> None:
    ap.add_argument("--model", default="smollm2-135m-bd")
    add_run_arguments(ap, prompts=4, name="ab_mask_lora")


def mask_lora_arms(args, ap):
    from dspec.models.mask_adapter import MaskLoraLinear

    amx, avx = dspec.load(args.model), dspec.load(args.model)
    for m in avx.modules():
        if isinstance(m, MaskLoraLinear):
            m.lora_packed = lambda: None  # no packed adapter: dspec._C.mask_lora's AVX-512 code
    args.packed_adapter = any(m.lora_packed() is not None for m in amx.modules() if isinstance(m, MaskLoraLinear))
    arms = []
    for kind, model in (("amx", amx), ("avx512", avx)):
        for name, method, options in MASK_LORA_CONFIGS:
            ref = None if name == "diffusion-static-1" or method == "s2d2" else f"diffusion-static-1 {kind}"
            arms.append(Arm(f"{name} {kind}", model, method, options, reference=ref))
    arms.sort(key=lambda a: a.reference is not None)  # references first
    baselines = {
        "avx512": {f"{c[0]} amx": f"{c[0]} avx512" for c in MASK_LORA_CONFIGS},
        "one_token_diffusion": {a.name: f"diffusion-static-1 {a.name.split()[1]}" for a in arms},
    }
    return arms, amx, baselines


# ----------------------------------------------------------------------------- the tool

KINDS = {
    "adapters": (adapters_arguments, adapters_arms),
    "drafters": (drafters_arguments, drafters_arms),
    "options": (options_arguments, options_arms),
    "glue": (glue_arguments, glue_arms),
    "selfspec": (selfspec_arguments, selfspec_arms),
    "diffuspec": (diffuspec_arguments, diffuspec_arms),
    "mask-lora": (mask_lora_arguments, mask_lora_arms),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    parsers = {}
    for kind, (arguments, _) in KINDS.items():
        parsers[kind] = sub.add_parser(kind)
        arguments(parsers[kind])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    arms, grid_model, baselines = KINDS[args.kind][1](args, parsers[args.kind])
    acc = run_interleaved(arms, grid_texts(grid_model, args.prompts), args.max_new_tokens)
    rows = summary_rows(arms, acc, baselines)
    bench = f"ab_{args.kind.replace('-', '_')}"
    payload = {"bench": bench, "env": environment("cpu"), "config": vars(args), "rows": rows}
    write_json(Path(__file__).resolve().parent / "results" / "cpu" / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()

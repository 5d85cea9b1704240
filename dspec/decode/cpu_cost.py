"""What a verified row costs on the CPU, for the methods' device-aware defaults.

On a CPU with AMX tiles a verification forward's projections take 16 rows per tile pass:
up to 16 rows a forward of SmolLM2-135M costs about one row's plus ~1.6 % a row (16 rows
~1.25x one), and the 17th row makes every weight tile be read a second time (~1.5x).  On an
accelerator extra rows are nearly free, so these defaults apply to CPU models only; an
explicit option always wins.  (Measured on an Intel Xeon with AMX-BF16, bf16, 2 threads;
docs/performance.md and bench/results/cpu/amx/ab_*.json; the self-speculative rounds of ``ssd`` /
``spiffy`` take two tile passes, below.)
"""

from __future__ import annotations

import torch

from .bounds import MAX_DRAFT_LEN, MAX_TREE_NODES, check_max

_BF16_FP32 = (torch.bfloat16, torch.float32)

#: A forward of N rows of SmolLM2-135M after 256 cached tokens relative to a one-row forward,
#: per CPU cost class (``cost_class``) and dtype, measured in situ (weights from memory, reps
#: interleaved): "tiles" -- a CPU with AMX tiles, where a forward's rows are nearly free up
#: to a tile (Intel Xeon AMX, bf16, 2 threads, docs/performance.md); "avx512" -- the
#: AVX-512 / AVX512_BF16 tiles of a CPU without AMX, where rows past a few are FMA work
#: (EPYC Zen 4, one thread, level avx512 of bench/results/cpu/avx2/dispatch_zen4.json); "avx2" --
#: dspec's AVX2 tiles, where every row past the first few is FMA work (an AVX2-only EPYC
#: Zen 3, 2 threads as its decodes run, bench/results/cpu/avx2/forward_zen3_2threads.json;
#: one thread: forward_zen3.json).
#: The "tiles" defaults below were tuned end to end on the AMX machine; the "avx2" ones follow
#: from this table (rows at their measured marginal cost).
FORWARD_COST = {
    "tiles": {"bfloat16": {1: 1.0, 8: 1.03, 16: 1.16, 32: 1.38, 64: 1.92}, "float32": {1: 1.0, 16: 1.57, 64: 3.45}},
    "avx512": {
        "bfloat16": {1: 1.0, 4: 1.13, 16: 2.20, 64: 7.48},
        "float32": {1: 1.0, 4: 1.07, 16: 2.26, 64: 8.11},
    },
    "avx2": {
        "bfloat16": {1: 1.0, 2: 1.09, 3: 1.21, 4: 1.42, 6: 1.71, 8: 2.12, 16: 3.63, 32: 6.37},
        "float32": {1: 1.0, 2: 1.20, 3: 1.34, 4: 1.47, 6: 1.73, 8: 1.93, 16: 2.59, 32: 4.39},
    },
}


def cost_class(model) -> str | None:
    """The CPU cost class of ``model``'s forwards: "tiles" on a CPU with AMX tiles (its
    float32 projections run AVX-512 beside them), "avx512" where they run the AVX-512 tiles
    of a CPU without AMX (or one capped below it), "avx2" where they run the AVX2 tiles or
    torch (no SIMD tiles), None off the CPU."""
    if model.device.type != "cpu":
        return None
    from .. import cpu
    from ..models.dense import linear_isa

    if model.dtype not in _BF16_FP32:  # no packed tiles for other dtypes
        return "avx2"
    isa = linear_isa(model.dtype)
    if isa == "amx" or (isa == "avx512" and cpu.isa() == "amx"):
        return "tiles"
    return "avx512" if isa == "avx512" else "avx2"


def row_cost_of(model) -> float:
    """One more verified row relative to a one-row forward for ``model`` on its CPU class:
    ``CPU_ROW_COST`` on the AMX and AVX-512 tiles ("tiles", "avx512": on an EPYC Zen 4
    ``dflash`` at 0.02 and 0.06 both ran 1.54x ``ar``,
    bench/results/cpu/avx512/e2e_dflash_zen4.json), the measured slope of ``FORWARD_COST`` to
    8 rows on AVX2."""
    if cost_class(model) != "avx2":
        return CPU_ROW_COST
    name = str(model.dtype).removeprefix("torch.") if model.dtype in _BF16_FP32 else "float32"
    table = FORWARD_COST["avx2"][name]
    return round((table[8] - 1.0) / 7, 3)


def forward_cost(model, rows: int) -> float | None:
    """A forward of ``rows`` rows of ``model`` relative to a one-row forward on its CPU class
    (``FORWARD_COST``, linear between the measured row counts and along the last slope past
    the largest); None off the CPU."""
    cls = cost_class(model)
    if cls is None:
        return None
    name = str(model.dtype).removeprefix("torch.") if model.dtype in _BF16_FP32 else "float32"
    table = sorted(FORWARD_COST[cls][name].items())
    for (r0, c0), (r1, c1) in zip(table, table[1:]):
        if rows <= r1 or (r1, c1) == table[-1]:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    return table[0][1]


def drafter_cost(model, drafter, rows: int) -> float | None:
    """A block drafter's forward of ``rows`` slots (the anchor and the drafts) relative to a
    one-row forward of ``model``, its target, on the CPU, from the weights each reads: the
    drafter's layers at ``rows`` rows and its head (the draft vocabulary's rows of the
    target's) at ``rows - 1``, against every weight of the target at one row, each at
    ``forward_cost``'s price.  None off the CPU.  (SmolLM2-135M and its shipped 3-layer
    drafter, bf16, AVX2 Zen 3, 2 threads: 0.32 estimated for a block of 8, 6.2 ms of drafting
    per cycle against a 17.5 ms ``ar`` step measured, 0.35.)"""
    if forward_cost(model, 1) is None:
        return None
    layers = sum(p.numel() for layer in drafter.layers for p in layer.parameters())
    vocab = drafter.draft_vocab
    head = (drafter.config.vocab_size if vocab is None else vocab.numel()) * drafter.config.hidden_size
    target = sum(p.numel() for p in model.parameters())
    return (layers * forward_cost(model, rows) + head * forward_cost(model, max(1, rows - 1))) / target


def resolve_ar_fallback(model, fallback, *, row_cost) -> bool:
    """``ar_fallback`` as ``dflash`` takes it: "auto" (the default) is True for a CPU model of
    the "avx2" cost class whose cycles are priced (``row_cost`` not None) -- there a drafting
    cycle of SmolLM2-135M costs ~1.4 ``ar`` steps at two verified rows, about what the shipped
    drafter's chat drafts earn (MT-Bench: 1.44 tokens per cycle, 0.95x ``ar`` drafting every
    cycle, 0.99x with the fallback, bench/results/cpu/avx2/e2e_smollm2_zen3_dflash.json) --
    and False elsewhere (on the AMX / AVX-512 tiles a cycle costs ~1.2 steps); a bool as
    given, True needing a row cost."""
    if isinstance(fallback, str) and fallback == "auto":
        return row_cost is not None and cost_class(model) == "avx2"
    if not isinstance(fallback, bool):
        raise ValueError(f"ar_fallback must be 'auto' or a bool, got {fallback!r}")
    if fallback and (row_cost is None or cost_class(model) is None):
        raise ValueError(
            "ar_fallback=True prices a cycle by the CPU's forward costs: it needs a CPU model and a row_cost (not None)"
        )
    return fallback


#: block rows a CPU self-speculative round (``ssd``, ``spiffy``) carries by default: two
#: passes over every AMX weight tile.  Re-measured with the self-consistent round-8 adapter
#: (smollm2-135m-bd, block size 4, 32 grid prompts, one process each;
#: bench/results/cpu/amx/ab_ssd_draft_len_2026-11-29.json, ab_spiffy_prune_2026-11-29.json,
#: ab_ssd_block8_2026-11-29.json): its drafts now survive long enough that a second tile pass
#: pays -- `ssd` draft_len 2 (12 + 4 rows) 1.61x one-token `diffusion` at 1.82 mean
#: accepted, draft_len 3 with the swapped states (28 rows) 1.69x at 2.49; `spiffy` prune_to
#: 2 1.57x at 1.81, 4 1.56x, 6 (32 rows) 1.63x at 2.58, 8 1.51x, 12 1.36x; at block size 8
#: `ssd` draft_len 1 (24 rows) 82.3 tok/s, 2 (32) 77.7, 2 with swaps (40) 81.4.
CPU_ROW_BUDGET = 32

#: the budget per request otherwise: in a batch every row is compute (batch 8, 32 prompts
#: per set, bench/results/cpu/amx/e2e_smollm2_batch8_2026-11-29.json and
#: e2e_smollm2_batch8_small_2026-11-29.json: against one-token `diffusion`
#: `ssd` draft_len 1 1.03x, 2 1.00x, 2 with swaps 0.88x, 3 with swaps 0.79x; `spiffy`
#: prune_to 1 1.01x, 2 0.98x, 6 0.75x), and sampling accepts too little to pay for the
#: second tile pass (T = 1, batch 1, 16 prompts per set, e2e_smollm2_t1_2026-11-29.json: `ssd`
#: draft_len 2 1.01x against 3 with swaps 0.90x, `spiffy` prune_to 2 1.05x against 6 0.99x)
CPU_SMALL_ROW_BUDGET = 16

#: the budget on the "avx512" cost class, greedy or not: without AMX a 32-row round costs more
#: than its longer drafts gain (SmolLM2-135M-bd, EPYC Zen 4, bf16, 2 threads, 8 grid prompts
#: x 64 tokens, one process each, against one-token `diffusion`: `ssd` 32 rows 1.16x,
#: draft_len 2 without swaps (16 rows) 1.26x, 3 without 1.15x; `spiffy` prune_to 6 1.04x,
#: 2 1.22x, 3 1.16x, bench/results/cpu/avx512/e2e_selfspec_zen4.json; with this budget,
#: `ssd` draft_len 1 1.25x and `spiffy` prune_to 2 1.19x, e2e_selfspec_defaults_zen4.json;
#: 16 grid prompts x 128 tokens: `spiffy` prune_to 2 1.257x, 6 1.120x, ab_spiffy_budget_zen4.json)
CPU_AVX512_ROW_BUDGET = CPU_SMALL_ROW_BUDGET


def swapped_states_pay(model) -> bool:
    """Whether ``ssd``'s swapped-pair states (``mixed_order``) are on by default for
    ``model``: not on the "avx512" class, where the 16-row round takes the longer chain
    instead (SmolLM2-135M-bd, EPYC Zen 4, bf16, 2 threads, 16 grid prompts x 128 tokens, one
    process, against one-token `diffusion`: draft_len 2 without swaps 1.371x, draft_len 1
    (the longest chain with swaps in 16 rows) 1.306x, draft_len 3 with swaps (28 rows)
    1.258x; bench/results/cpu/avx512/ab_ssd_budget_zen4.json)."""
    return cost_class(model) != "avx512"


#: the budget on the "avx2" cost class, greedy or not: every row is FMA work there (12 rows
#: of fp32 cost ~2.3 one-row forwards, bf16 ~3.1: ``FORWARD_COST``), so a round carries the
#: fewest copies a round can (the root, one draft, the next block at block size 4)
CPU_AVX2_ROW_BUDGET = 12


def cpu_block_copies(model, block_size: int, batch: int = 1, temperature: float = 0.0) -> int | None:
    """The most block copies (root, drafts, the next block's first state) a self-speculative
    round forwards per request by default on the CPU: on the "tiles" class
    ``CPU_ROW_BUDGET // block_size`` for one request decoded greedily, else
    ``CPU_SMALL_ROW_BUDGET // block_size``; ``CPU_AVX512_ROW_BUDGET`` / ``CPU_AVX2_ROW_BUDGET``
    rows on the "avx512" / "avx2" classes; at least 3
    (the root, one draft and the next block); None elsewhere (extra rows are nearly free on
    an accelerator at these sizes).  The budget was 16 rows everywhere while the adapter's
    drafts died sooner (an earlier adapter, ab_ssd_draft_len_2026-11-27.json: `ssd` block 4 draft_len 2 1.26x
    one-token `diffusion`, 3 1.14x; `spiffy` prune_to 2 1.17x, 8 1.14x)."""
    if model.device.type != "cpu":
        return None
    cls = cost_class(model)
    if cls == "avx2":
        return max(3, CPU_AVX2_ROW_BUDGET // block_size)
    if cls == "avx512":
        return max(3, CPU_AVX512_ROW_BUDGET // block_size)
    greedy_single = batch <= 1 and temperature <= 0
    return max(3, (CPU_ROW_BUDGET if greedy_single else CPU_SMALL_ROW_BUDGET) // block_size)


#: one more verified row relative to a one-row forward, for ``row_cost="auto"`` on the CPU
#: (dflash: 0.02 / 0.06 / 0.12 all 1.25-1.26x ``ar`` against 1.22x verifying every draft;
#: d2sd K = 2: 0.02 0.98x, 0.06 0.96x, every branch in full 0.82x)
CPU_ROW_COST = 0.02


def resolve_row_cost(model, row_cost, *, prunes: bool = True):
    """``row_cost`` as the methods take it: "auto" (the default) is ``row_cost_of(model)`` for
    a CPU model whose method prunes by it (``prunes``) -- ``CPU_ROW_COST`` on the tiles, the
    measured AVX2 slope there -- and None (verify everything) otherwise; None or a finite
    number >= 0 as given."""
    if isinstance(row_cost, str) and row_cost == "auto":
        return row_cost_of(model) if prunes and model.device.type == "cpu" else None
    if row_cost is not None and (
        isinstance(row_cost, bool) or not isinstance(row_cost, (int, float)) or not 0 <= row_cost < float("inf")
    ):
        raise ValueError(f"row_cost must be 'auto', None or a finite number >= 0, got {row_cost!r}")
    return row_cost


#: draft-tree nodes of ``dflash``'s ``tree="auto"`` on a CPU model, greedy: 7 nodes keep the
#: chain's 8 rows (SmolLM2-135M, round-8 drafter, grid prompts, one process each: tree 7
#: 1.196x / 1.218x ``ar`` against the chain's 1.152x / 1.187x on 20 / 32 prompts per set;
#: 15 nodes 1.186x)
CPU_TREE_NODES = 7


def resolve_tree(model, tree, temperature: float):
    """``tree`` as ``dflash`` takes it: "auto" (the default) is ``CPU_TREE_NODES`` for a CPU
    model of the "tiles" cost class decoding greedily and None (the chain) otherwise -- at
    T > 0 a tree drawn from the drafter and verified against its q takes more tokens per
    forward than the chain but has not paid for its extra rows end to end
    (bench/results/cpu/amx/e2e_smollm2_t1_xeon_amx.json, avx512/e2e_smollm2_t1_epyc_zen5.json);
    None or an int in [1, ``MAX_TREE_NODES``] as given."""
    if isinstance(tree, str) and tree == "auto":
        # the "avx2" class: a tree's extra rows cost more than its extra accepts (SmolLM2-135M,
        # 8 grid prompts, 2 threads, AVX2: bf16 chain 67.6 tok/s, tree 7 59.9; fp32 56.4 /
        # 55.7; bench/results/cpu/avx2/e2e_smollm2_avx2_*.json)
        on = model.device.type == "cpu" and temperature <= 0 and cost_class(model) != "avx2"
        return CPU_TREE_NODES if on else None
    if tree is not None and (isinstance(tree, bool) or not isinstance(tree, int) or tree < 1):
        raise ValueError(f"tree must be 'auto', None (a chain) or an int >= 1 (draft nodes per tree), got {tree!r}")
    check_max("tree", tree, MAX_TREE_NODES, "MAX_TREE_NODES")
    return tree


# Prompt-lookup drafts grafted onto the verification tree of a CPU model decoding greedily
# (dflash / d2sd / diffuspec ``lookup``), for batches of at most CPU_LOOKUP_MAX_BATCH
# requests. Measured on SmolLM2-135M (bench/results/cpu/amx/e2e_smollm2_*lookup*_2026-11-27.json,
# 32 prompts): batch 1 dflash 1.55x -> 1.99x ar, diffuspec 1.24x -> 1.39x; batch 4 1.151x ->
# 1.245x and 0.914x -> 0.962x; batch 8, where every verified row is compute, 0.905x ->
# 0.871x and 0.714x -> 0.692x.
CPU_LOOKUP_DRAFTS = 7
CPU_LOOKUP_MAX_BATCH = 4


def resolve_lookup(model, lookup, *, tree: bool, temperature: float, batch: int):
    """``lookup`` as ``dflash`` / ``d2sd`` / ``diffuspec`` take it: "auto" (the default) is
    ``CPU_LOOKUP_DRAFTS`` for a CPU model decoding greedily a batch of at most
    ``CPU_LOOKUP_MAX_BATCH`` requests whose cycles verify a tree (``tree``), None otherwise;
    None, 0 (off) or an int in [1, ``MAX_DRAFT_LEN``] as given, which needs a tree."""
    if isinstance(lookup, str) and lookup == "auto":
        on = tree and model.device.type == "cpu" and temperature <= 0 and batch <= CPU_LOOKUP_MAX_BATCH
        return CPU_LOOKUP_DRAFTS if on else None
    if lookup is not None and (isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0):
        raise ValueError(f"lookup must be 'auto', None, 0 or an int >= 1 (lookup drafts per cycle), got {lookup!r}")
    check_max("lookup", lookup, MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    if lookup and not tree:
        raise ValueError(
            "lookup: prompt-lookup drafts are grafted onto a verification tree, which this "
            "configuration does not build (dflash: tree=None, the chain; diffuspec: T > 0)"
        )
    return lookup or None


# S2D2's redraft blocks (``s2d2(redraft=...)``) on a CPU model, for batches of at most
# CPU_REDRAFT_MAX_BATCH requests: their rows are nearly free while a forward is one row's
# weight pass, and compute once a batch fills the tiles.  Measured on smollm2-135m-bd with
# S2D2's compiled step (bench/results/cpu/amx/e2e_s2d2_native_batch*_2026-11-28.json, greedy, policy
# always, 8 prompts per set, against S2D2's own speculative block alone): batch 2 131.3
# against 121.1 tok/s, batch 4 163.9 against 168.9, batch 8 201.1 against 214.3 (the torch
# step with policy min_span: 105.5 / 134.5 / 159.0; ``ar`` 120.4 / 215.9 / 366.4).
CPU_REDRAFT_MAX_BATCH = 2


def resolve_redraft(model, redraft, *, batch: int) -> bool:
    """``redraft`` as ``s2d2`` takes it: "auto" (the default) is True except for a CPU model
    decoding more than ``CPU_REDRAFT_MAX_BATCH`` requests; a bool as given."""
    if isinstance(redraft, str) and redraft == "auto":
        return not (model.device.type == "cpu" and batch > CPU_REDRAFT_MAX_BATCH)
    if not isinstance(redraft, bool):
        raise ValueError(f"redraft must be 'auto' or a bool, got {redraft!r}")
    return redraft


# S2D2's boundary state (``s2d2(boundary=...)``) on a CPU model: off.  It saves the drafting
# forward after a rejected last draft (7 % fewer forwards, 1.69 -> 1.82 tokens per forward),
# but it takes a verification from 13 rows to 18 (26 behind a pending block), past the
# 16-row AMX tile, where a forward of smollm2-135m-bd costs 19.2 / 20.9 ms against 16.2 ms
# (in-situ medians, 2 threads, bench/results/cpu/amx/widths_s2d2_2026-11-29.json): measured on 32 grid
# prompts, greedy, batch 1, the compiled step (bench/results/cpu/amx/ab_s2d2_boundary_2026-11-29.json),
# 101.4 against 110.4 tok/s, outputs equal.  Other devices, where such rows are free: on.
def resolve_boundary(model, boundary, *, redraft: bool) -> bool:
    """``boundary`` as ``s2d2`` takes it: None (the default) is True where it applies --
    redraft blocks on a right-shifted model whose clean rows attend causally -- except on a
    CPU model; True where it does not apply raises ValueError."""
    applies = redraft and bool(model.shifted) and bool(getattr(model.config, "clean_causal", False))
    if boundary is None:
        return applies and model.device.type != "cpu"
    if not isinstance(boundary, bool):
        raise ValueError(f"boundary must be None or a bool, got {boundary!r}")
    if boundary and not applies:
        raise ValueError(
            "boundary=True needs redraft blocks (redraft=True) on a right-shifted model whose clean "
            "rows attend causally (config.clean_causal)"
        )
    return boundary


# D2SD's re-draft gate (``d2sd(redraft_min=...)``) on a CPU model: never re-draft.  The
# VP-drafter forward, its extra tree nodes and their pruning cost ~20 % of a cycle of
# SmolLM2-135M, where the shipped VP-drafter's re-drafts add ~3 % tokens per cycle, and no
# gate recovers the difference: one process, 32 grid prompts x 128 tokens, greedy, K = 2
# (bench/results/cpu/amx/ab_d2sd_gate_2026-11-28.json): redraft_min 0 / 0.3 / 0.5 / 0.7 / 0.85 / inf
# 107.0 / 106.9 / 107.4 / 109.0 / 113.7 / 127.3 tok/s at 3.48 / 3.48 / 3.48 / 3.43 / 3.41 /
# 3.37 mean accepted, `dflash` 133.0 (3.37); at T = 1 and at batch 8 the re-drafts lose too
# (e2e_smollm2_t1.json, e2e_smollm2_batch8.json).  On an accelerator the drafter forward
# is small against the target's and every cycle re-drafts (0), as the paper does.
CPU_REDRAFT_MIN = float("inf")


def resolve_redraft_min(model, redraft_min, *, redrafts: bool) -> float:
    """``redraft_min`` as ``d2sd`` takes it: "auto" (the default) is ``CPU_REDRAFT_MIN`` for a
    CPU model whose branches are the VP-drafter's (``redrafts``) and 0 (re-draft every
    cycle) otherwise; a number >= 0 as given (the boundaries are disjoint events, their
    probabilities sum to at most 1: any value above 1, or inf, never re-drafts)."""
    if isinstance(redraft_min, str) and redraft_min == "auto":
        return CPU_REDRAFT_MIN if redrafts and model.device.type == "cpu" else 0.0
    if isinstance(redraft_min, bool) or not isinstance(redraft_min, (int, float)) or not redraft_min >= 0:
        raise ValueError(f"redraft_min must be 'auto' or a number >= 0 (inf: never re-draft), got {redraft_min!r}")
    if redraft_min > 0 and not redrafts:
        raise ValueError("redraft_min gates the VP-drafter's re-drafts: it needs branches='vp'")
    return float(redraft_min)

"""Upper bounds of the methods' size options, checked before a method allocates anything.

Every option that sizes a forward or a buffer -- a block size, a draft length, a tree's
node budget, a lookup chain, a beam, a draft graph -- has two bounds:

- **the context**: the longest prompt plus the rows one forward of the method carries at
  most (its worst case, which is also what its buffers are sized for) must fit the model's
  context (``config.max_position_embeddings``; the drafter's too where a drafter forwards
  them; :data:`UNKNOWN_CONTEXT` where a config gives none).  Each method documents its row
  count: e.g. ``diffusion`` on a block-causal model forwards two blocks (the finished one
  and the next), ``2 * block_size``;
- **a documented maximum** for the counts no context bounds tightly (the work per cycle
  grows with them, and past these values a larger one only costs): :data:`MAX_DRAFT_LEN`,
  :data:`MAX_TREE_NODES`, :data:`MAX_GRAPH_NODES`, :data:`MAX_BEAM`.

A value past either bound is a ValueError naming the option and the bound.
"""

from __future__ import annotations

#: the most tokens one cycle drafts: ``draft_len`` (every method), ``k_max`` / ``k_min``
#: (diffuspec's ADL) and ``lookup`` (the prompt-lookup chain)
MAX_DRAFT_LEN = 256

#: the most draft nodes of one verification tree (``tree`` of dflash / d2sd)
MAX_TREE_NODES = 256

#: the most draft nodes of a Spiffy draft graph (``graph_size``, or a given graph)
MAX_GRAPH_NODES = 256

#: the widest path search (diffuspec's ``beam``)
MAX_BEAM = 256

#: the context assumed for a model whose config gives none (``max_position_embeddings`` 0)
UNKNOWN_CONTEXT = 32768


def context_of(*models) -> tuple[int, str]:
    """The smallest context of ``models`` (None entries skipped) and a description of it."""
    best, where = None, ""
    for m in models:
        if m is None:
            continue
        ctx = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 and (best is None or ctx < best):
            best, where = ctx, "the drafter's" if m is not models[0] else "the model's"
    if best is None:
        return UNKNOWN_CONTEXT, f"the context assumed without max_position_embeddings ({UNKNOWN_CONTEXT})"
    return best, f"{where} context of {best} (max_position_embeddings)"


def check_max(name: str, value, maximum: int, constant: str) -> None:
    """ValueError unless int ``value`` is at most ``maximum`` (``constant``: its name)."""
    if value is not None and not isinstance(value, bool) and isinstance(value, int) and value > maximum:
        raise ValueError(f"{name} must be at most {maximum} (dspec.decode.bounds.{constant}), got {value}")


def check_rows(model, prompts, name: str, value, rows: int, formula: str, *, drafter=None) -> None:
    """ValueError unless the longest of ``prompts`` (token-id lists, or an int: the longest
    length) plus ``rows`` -- what one forward carries at most with option ``name`` =
    ``value``, ``formula`` says how -- fits the context of ``model`` (and ``drafter``)."""
    longest = prompts if isinstance(prompts, int) else max((len(p) for p in prompts), default=0)
    ctx, where = context_of(model, drafter)
    if longest + rows > ctx:
        raise ValueError(
            f"{name} = {value} is too large: one forward carries up to {formula} = {rows} rows, "
            f"and the longest prompt ({longest} tokens) plus them is {longest + rows}, past "
            f"{where}; the bound is longest prompt + {formula} <= {ctx}"
        )

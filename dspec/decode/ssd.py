"""Method ``ssd``: lossless Self Speculative Decoding (SSD) for block-causal dLLMs.

Self Speculative Decoding for dLLMs is arXiv 2510.04147; it is not "Speculative Speculative
Decoding" (arXiv 2603.03251), a different method that is also called SSD.

Equal to ``diffusion`` with one token per step (greedy: the same tokens; sampling: the same
distribution), in fewer forwards.  One forward both verifies the previous round's drafts
and drafts the next ones:

- at a state S with known logits, the masked slots of the current block are ordered by the
  one-token-per-step rule (confidence of S's choice, descending, ties to the lower slot);
  the first is S's exact step (the root c0), the next ``draft_len`` are drafts with S's
  choices: the chain c0, c1 = c0 + draft 1, ..., the states the diffusion would visit if the
  drafts were right;
- the chain is verified as ONE suffix of block copies (:func:`dspec.masks.ssd_copies`: each
  copy bidirectional within itself, all sharing the cached prefix, which is read once);
- when the chain completes the block, the next block's first (all-[MASK]) state rides in
  the same forward, attending to the completed copy: the commit forward of the reference
  (which a one-step run spends once per block) is merged into the verification forward, and
  the next block's first drafts come with it;
- accept down the chain while each state's real step (most confident masked slot and its
  token, the reference rule) equals the next draft; the last accepted state's own step is
  the next round's root (every round commits >= 1 step) and its logits are the next round's
  drafts: no separate draft forward;
- ``mixed_order``: the chain also carries c_k + draft (k + 2), so a node verifies its
  grandchild c_{k+2} when two drafts come out of order (lossless: the swapped state is
  itself forwarded and verified).

NFE: 1 prefill (the prompt's complete blocks), then one forward per round; the first round
only forwards the first block's state (its logits are needed to draft).  A one-step run
takes 1 prefill + per block (masked slots + 1 commit) forwards.

Host syncs: two small reads per round (copies to forward; accepted steps / committed
blocks), see :mod:`dspec.decode.selfspec`.
"""

from __future__ import annotations

from .bounds import MAX_DRAFT_LEN, check_max, check_rows
from .cpu_cost import cpu_block_copies, swapped_states_pay
from .selfspec import chain_graph, check_common, decode_self_speculative

OPTIONS = ("block_size", "draft_len", "mixed_order")
DRAFTER = False
DEFAULT_DRAFT_LEN = 4


def paper_options(model, given: dict) -> dict:
    """``preset="paper"``: SSD as published -- every masked position of the block drafted
    (``draft_len = block_size - 1``, at least 1) and the chain of states verified alone (no
    swapped-pair states: ``mixed_order=False``), free of the CPU's row budget."""
    bs = check_common(model, "ssd", given.get("block_size"))
    return {"draft_len": max(bs - 1, 1), "mixed_order": False}


def decode(
    model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator=None,
    eos_ids=(),
    progress=None,
    block_size: int | None = None,
    draft_len: int | None = None,
    mixed_order: bool | None = None,
):
    """SSD decoding of a ragged batch; returns (tokens per request, stats).

    Parameters
    ----------
    model : a block-causal masked-diffusion ``Model`` (SDAR, Fast-dLLM v2).
    prompts : B lists of prompt token ids (ragged).
    max_new_tokens, temperature, generator, eos_ids, progress : as ``diffusion``.
    block_size : int >= 1, default the model's.
    draft_len : int in [1, ``MAX_DRAFT_LEN``], drafted steps per round after the exact root step (the
        verification suffix holds draft_len + 1 block copies, + 1 next-block copy when the
        chain completes the block); default ``min(block_size - 1, 4)`` (at least 1) -- longer
        chains rarely survive past 4 steps on the shipped model -- and on the CPU the longest
        whose round (with ``mixed_order``'s swapped states) fits 32 rows for one request
        decoded greedily, else 16 per request, 16 without the swapped states on AVX-512 tiles
        without AMX, and 12 on AVX2 tiles, where every row is FMA work
        (:func:`dspec.decode.cpu_cost.cpu_block_copies`: at block size 4 3, 1, 2 and 1).
    mixed_order : bool or None, also verify the swapped-pair states (draft_len - 1 more
        copies: a node verifies its grandchild when two drafts come out of order).  None
        (default): on, except on the CPU where an explicit draft_len's round would not fit
        the row budget with them, and on the "avx512" cost class, where the default chain
        is the longest the budget holds without them (``cpu_cost.swapped_states_pay``).

    Bounds (:mod:`dspec.decode.bounds`, checked before anything is built): a round
    forwards at most :func:`chain_copies` block copies, so the longest prompt +
    ``chain_copies(draft_len, mixed_order) * block_size`` (at least ``3 * block_size``: the
    root, one draft, the next block) must fit ``max_position_embeddings``.

    Returns
    -------
    tokens : B lists of generated ids.
    stats : ``nfe`` ({"target": forwards}), ``mean_accepted`` (denoising steps -- tokens --
        committed per verification round of a request: every round of a request whose
        state had logits; >= 1), ``accepted_hist`` ({steps per round: rounds}), ``drafts``
        (draft states forwarded), ``accepted_drafts``, ``rounds`` (forwards after the
        prefill), ``suffix_tokens`` (block tokens those forwards carried, over all rows: the
        compute a CPU pays; a one-step run carries B * block_size per forward),
        ``block_size``, ``draft_len``, ``mixed_order``.
    """
    bs = check_common(model, "ssd", block_size)
    if draft_len is not None and (isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1):
        raise ValueError(f"draft_len must be an int >= 1, got {draft_len!r}")
    if mixed_order is not None and not isinstance(mixed_order, bool):
        raise ValueError(f"mixed_order must be a bool or None, got {mixed_order!r}")
    check_max("draft_len", draft_len, MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    check_rows(model, prompts, "block_size", bs, chain_copies(1, False) * bs, "3 * block_size")
    if mixed_order is None and draft_len is None and not swapped_states_pay(model):
        mixed_order = False  # the longest chain of the round's budget instead of swaps
    n, mixed_order = default_chain(cpu_block_copies(model, bs, len(prompts), temperature), bs, draft_len, mixed_order)
    # (an explicit draft_len is the option to blame; else the block size, with the default draft_len)
    check_rows(
        model,
        prompts,
        "draft_len" if draft_len is not None else "block_size",
        n if draft_len is not None else bs,
        chain_copies(n, mixed_order) * bs,
        f"(draft_len + 2{' + draft_len - 1' if mixed_order else ''}) * block_size with draft_len = {n}",
    )
    tokens, stats = decode_self_speculative(
        model,
        prompts,
        graph=chain_graph(n, mixed_order),
        prune_to=None,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        eos_ids=eos_ids,
        progress=progress,
        block_size=bs,
    )
    stats.update(draft_len=n, mixed_order=mixed_order)
    return tokens, stats


def chain_copies(draft_len: int, mixed_order: bool) -> int:
    """Block copies of a round's worst case: the root, the drafts, the swapped states, the
    next block's first state."""
    return draft_len + 2 + (draft_len - 1 if mixed_order else 0)


def default_chain(
    max_copies: int | None, block_size: int, draft_len: int | None, mixed_order: bool | None
) -> tuple[int, bool]:
    """(draft_len, mixed_order) with the defaults resolved: ``max_copies`` None (no device
    cap) or the CPU's block-copy budget, which the defaults respect and explicit values
    override; mixed_order is reported False where the chain has no pair to swap."""

    def fits(n: int, mixed: bool) -> bool:
        return max_copies is None or chain_copies(n, mixed) <= max_copies

    if draft_len is None:
        mixed = mixed_order is not False
        n = min(max(1, block_size - 1), DEFAULT_DRAFT_LEN)
        while n > 1 and not fits(n, mixed):
            n -= 1
    else:
        n = draft_len
        mixed = fits(n, True) if mixed_order is None else mixed_order
    return n, mixed and n >= 2

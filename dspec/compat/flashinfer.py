"""flashinfer's speculative-sampling and state-merging calls, on any device dspec runs on.

The four functions keep flashinfer's names, argument names, defaults, dtypes and return
values (``flashinfer.sampling.chain_speculative_sampling``, ``flashinfer.merge_state``,
``flashinfer.merge_state_in_place``, ``flashinfer.merge_states``), so an engine written
against flashinfer imports this module where flashinfer cannot run (a CPU).  The work is
done by dspec's ops (:func:`dspec.verify_chain`, :func:`dspec.merge_states`); the
conventions are converted here:

* flashinfer's log-sum-exp values are base 2 (``log2(sum(exp(score)))``); dspec's are
  natural logs.  ``s * ln 2`` goes in, ``lse / ln 2`` comes out.
* flashinfer takes target *probabilities*; dspec takes logits and a temperature, so
  ``log(target_probs)`` goes in at temperature 1 (``softmax(log p) = p`` for a normalised row).
* flashinfer returns int32 ids and counts; dspec returns int64.
* flashinfer draws its uniforms from ``generator`` or from a Philox stream keyed by
  ``(seed, offset)``; here they are drawn with torch from ``generator``, or from a torch
  generator seeded by ``(seed, offset)``: equal ``(seed, offset)`` give equal results, but
  not flashinfer's own random stream.
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..ops.attention import merge_states as _dspec_merge_states
from ..ops.verify import verify_chain

__all__ = ["chain_speculative_sampling", "merge_state", "merge_state_in_place", "merge_states"]

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_V_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.uint8)
_SEED_DTYPES = tuple(d for d in (torch.int64, getattr(torch, "uint64", None)) if d is not None)
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------
# chain speculative sampling
# ---------------------------------------------------------------------------------------


def _scalar_seed(name: str, value, device: torch.device, batch: int) -> int:
    """An int seed / offset, or element 0 of a 1-D int64 / uint64 tensor of length 1 or B
    (flashinfer's kernel reads element 0 of such a tensor)."""
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise ValueError(f"{name} is on {value.device}, expected {device} like draft_probs")
        if value.dtype not in _SEED_DTYPES:
            raise ValueError(
                f"{name} tensor must have dtype int64 or uint64, got {str(value.dtype).replace('torch.', '')}"
            )
        if value.dim() != 1 or value.shape[0] not in (1, batch):
            raise ValueError(
                f"{name} tensor must be 1-D of length 1 or batch_size = {batch}, got shape {list(value.shape)}"
            )
        return int(value[0].item()) & _MASK64
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int or a 1-D int64 tensor, got {type(value).__name__}")
    return value & _MASK64


def _generator_for(seed, offset, device: torch.device, batch: int) -> torch.Generator:
    """A torch generator on ``device`` keyed by ``(seed, offset)`` (splitmix64 of the pair)."""
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError(
            "seed and offset must both be tensors or both be ints, got "
            f"{type(seed).__name__} and {type(offset).__name__}"
        )
    x = (
        _scalar_seed("seed", seed, device, batch) * 0x9E3779B97F4A7C15 + _scalar_seed("offset", offset, device, batch)
    ) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    gen = torch.Generator(device=device)
    gen.manual_seed(x >> 1)  # a non-negative 63-bit seed
    return gen


def _count_output(name: str, t, batch: int, device: torch.device):
    if t is None:
        return None
    _validate.tensor(name, t, dim=1, dtypes=_validate.ID_DTYPES)
    if t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [batch_size] = [{batch}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like draft_probs")
    return t


def _check_probabilities(name: str, t: torch.Tensor) -> None:
    if t.numel() and _validate.value_checks_enabled(t):
        bad = ~((t >= 0) & (t <= 1))  # NaN fails both
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} must hold probabilities in [0, 1]; {name}{at} = {float(t[tuple(at)])}")


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num=None,
    maybe_output_emitted_draft_token_num=None,
    deterministic=True,
    generator=None,
    seed=None,
    offset=None,
):
    """Speculative sampling of a chain of drafts (Leviathan et al. / Chen et al.), flashinfer's call.

    Draft ``i`` of a row is accepted iff ``u * draft_probs[b, i, x] < target_probs[b, i, x]``
    (``x = draft_token_ids[b, i]``, ``u`` uniform); at the first rejection one token is drawn
    from ``max(target - draft, 0)`` renormalised, and when every draft is accepted a bonus
    token is drawn from ``target_probs[b, L]``.  Runs :func:`dspec.verify_chain` on
    ``log(target_probs)`` at temperature 1.

    Parameters
    ----------
    draft_probs : float32/float16/bfloat16 [B, L, V]
        The drafter's distribution at each draft position.
    draft_token_ids : int32/int64 [B, L]
        The drafted ids, in ``[0, V)``.
    target_probs : float32/float16/bfloat16 [B, L + 1, V]
        The target's distribution after 0..L accepted drafts; each row is read as a
        distribution (renormalised; normalised rows are used as they are).
    maybe_output_accepted_token_num : int32/int64 [B], optional
        When given, the per-row count of drafts that pass the test when each is tested on its
        own (the accepted prefix, plus drafts from the first rejection on that pass a fresh
        test: a measure of drafter/target agreement) is *added* to it in place.
    maybe_output_emitted_draft_token_num : int32/int64 [B], optional
        When given, the number of drafts emitted per row (bonus excluded) is added in place.
    deterministic : bool, default True
        Accepted for compatibility; dspec's kernels are deterministic for given uniforms.
    generator : torch.Generator, optional
        Source of the uniforms (on the tensors' device type); ignored when both ``seed`` and
        ``offset`` are given.
    seed, offset : int or int64/uint64 tensor [1] or [B], optional
        Both given: the uniforms come from a generator keyed by ``(seed, offset)`` (element
        0 of a tensor, as in flashinfer), so equal pairs give equal results.  Reading a
        tensor's value synchronises with the device.

    Returns
    -------
    output_token_ids : int32 [B, L + 1]
        The emitted drafts, then the one drawn token, then -1.
    output_accepted_token_num : int32 [B] (or the given tensor, updated in place)
    output_emitted_draft_token_num : int32 [B] (or the given tensor, updated in place)

    Raises
    ------
    ValueError
        Naming the argument, for a wrong rank, shape, dtype or device, ids outside ``[0, V)``
        or probabilities outside ``[0, 1]`` (value checks follow ``dspec.config.validate_values``).

    Example
    -------
    >>> import torch
    >>> from dspec.compat.flashinfer import chain_speculative_sampling
    >>> draft = torch.tensor([[[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]])
    >>> target = torch.tensor([[[0.2, 0.2, 0.6], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    >>> ids, accepted, emitted = chain_speculative_sampling(draft, torch.tensor([[2, 1]], dtype=torch.int32), target)
    >>> ids.tolist(), ids.dtype, accepted.tolist(), emitted.tolist()
    ([[2, 2, -1]], torch.int32, [1], [1])
    """
    _validate.tensor("draft_probs", draft_probs, dim=3, dtypes=_validate.FLOAT_DTYPES)
    _validate.tensor("draft_token_ids", draft_token_ids, dim=2, dtypes=_validate.ID_DTYPES)
    _validate.tensor("target_probs", target_probs, dim=3, dtypes=_validate.FLOAT_DTYPES)
    batch, length, vocab = draft_probs.shape
    if tuple(draft_token_ids.shape) != (batch, length):
        raise ValueError(
            f"draft_token_ids must have shape [batch_size, num_speculate_tokens] = "
            f"[{batch}, {length}] like draft_probs, got {list(draft_token_ids.shape)}"
        )
    if tuple(target_probs.shape) != (batch, length + 1, vocab):
        raise ValueError(
            f"target_probs must have shape [batch_size, num_speculate_tokens + 1, "
            f"vocab_size] = [{batch}, {length + 1}, {vocab}], got {list(target_probs.shape)}"
        )
    if vocab == 0:
        raise ValueError("draft_probs has an empty vocabulary (last dimension is 0)")
    device = draft_probs.device
    _validate.same_device(device, "draft_probs", draft_token_ids=draft_token_ids, target_probs=target_probs)
    accepted_out = _count_output("maybe_output_accepted_token_num", maybe_output_accepted_token_num, batch, device)
    emitted_out = _count_output(
        "maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, batch, device
    )
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    _validate.generator(generator, device, like="draft_probs")
    if seed is not None and offset is not None:
        generator = _generator_for(seed, offset, device, batch)
    if draft_token_ids.numel() and _validate.value_checks_enabled(draft_token_ids):
        bad = (draft_token_ids < 0) | (draft_token_ids >= vocab)
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            raise ValueError(
                f"draft_token_ids holds ids outside the vocabulary [0, {vocab}): "
                f"{int(draft_token_ids[tuple(at)])} at {at}"
            )
    _check_probabilities("draft_probs", draft_probs)
    _check_probabilities("target_probs", target_probs)

    draft32, target32 = draft_probs.float(), target_probs.float()
    coins = torch.rand((batch, length), generator=generator, device=device)
    uniforms = torch.rand((batch,), generator=generator, device=device)
    fresh = torch.rand((batch, length), generator=generator, device=device)
    with _validate.decode_values_trusted():  # the inputs were checked above
        out = verify_chain(
            draft_token_ids, target32.log(), draft_probs=draft32, temperature=1.0, coins=coins, sample_uniforms=uniforms
        )
    emitted = out.num_accepted
    # the independent test: drafts from the first rejection on, each with a fresh uniform
    ids = draft_token_ids.long().clamp(0, vocab - 1).unsqueeze(-1)
    p = target32[:, :length].gather(-1, ids).squeeze(-1)
    q = draft32.gather(-1, ids).squeeze(-1)
    after = torch.arange(length, device=device)[None, :] >= emitted[:, None]
    accepted = emitted + (after & (fresh * q < p)).sum(-1)

    if accepted_out is None:
        accepted_out = accepted.to(torch.int32)
    else:
        accepted_out.add_(accepted.to(accepted_out.dtype))
    if emitted_out is None:
        emitted_out = emitted.to(torch.int32)
    else:
        emitted_out.add_(emitted.to(emitted_out.dtype))
    return out.tokens.to(torch.int32), accepted_out, emitted_out


# ---------------------------------------------------------------------------------------
# attention states (base-2 log-sum-exp)
# ---------------------------------------------------------------------------------------


def _state(v_name: str, v, s_name: str, s, *, v_dim: int, s_float32: bool = False):
    _validate.tensor(v_name, v, dim=v_dim, dtypes=_V_DTYPES)
    _validate.tensor(s_name, s, dim=v_dim - 1, dtypes=(torch.float32,) if s_float32 else _validate.FLOAT_DTYPES)
    if tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"{s_name} must have shape {v_name}.shape[:-1] = {list(v.shape[:-1])}, got {list(s.shape)}")


def _pair(a_names, a, b_names, b, *, s_float32: bool = False):
    (va_name, sa_name), (va, sa) = a_names, a
    (vb_name, sb_name), (vb, sb) = b_names, b
    _state(va_name, va, sa_name, sa, v_dim=3, s_float32=s_float32)
    _state(vb_name, vb, sb_name, sb, v_dim=3)
    if vb.dtype != va.dtype:
        raise ValueError(
            f"{vb_name} must have the dtype of {va_name} "
            f"({str(va.dtype).replace('torch.', '')}), got {str(vb.dtype).replace('torch.', '')}"
        )
    if vb.shape != va.shape:
        raise ValueError(f"{vb_name} must have the shape of {va_name} {list(va.shape)}, got {list(vb.shape)}")
    _validate.same_device(va.device, va_name, **{sa_name: sa, vb_name: vb, sb_name: sb})


def _merge_base2(v_a, s_a, v_b, s_b):
    """dspec's natural-log merge of two states given and returned with base-2 lse."""
    v, lse = _dspec_merge_states(v_a, s_a.float() * _LN2, v_b, s_b.float() * _LN2)
    return v, lse * _LOG2E


def merge_state(v_a, s_a, v_b, s_b):
    """Merge the attention outputs and base-2 log-sum-exp of two disjoint key sets (flashinfer's call).

    Parameters
    ----------
    v_a, v_b : float32/float16/bfloat16 [seq_len, num_heads, head_dim], one dtype
        Each part's attention output, normalised over its own keys.
    s_a, s_b : float [seq_len, num_heads]
        Each part's log-sum-exp **in base 2**: ``log2(sum_j exp(score_j))``.

    Returns
    -------
    V : [seq_len, num_heads, head_dim] in v_a's dtype
        The attention output over the union of the two key sets.
    S : float32 [seq_len, num_heads]
        Its base-2 log-sum-exp.  Two empty states (``s = -inf``) give V = 0, S = -inf.

    Example
    -------
    >>> import torch
    >>> from dspec.compat.flashinfer import merge_state
    >>> v, s = merge_state(torch.ones(1, 1, 2), torch.zeros(1, 1), torch.zeros(1, 1, 2), torch.zeros(1, 1))
    >>> v.tolist(), s.tolist()
    ([[[0.5, 0.5]]], [[1.0]])
    """
    _pair(("v_a", "s_a"), (v_a, s_a), ("v_b", "s_b"), (v_b, s_b))
    return _merge_base2(v_a, s_a, v_b, s_b)


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (flashinfer's call; base-2 lse).

    Parameters
    ----------
    v : float32/float16/bfloat16 [seq_len, num_heads, head_dim]
        The state's output; overwritten with the merged output.
    s : float32 [seq_len, num_heads]
        Its base-2 log-sum-exp; overwritten with the merged one (float32, so that the
        update lands in the caller's tensor).
    v_other : [seq_len, num_heads, head_dim] in v's dtype
    s_other : float [seq_len, num_heads], base 2.
    mask : bool/uint8 [seq_len], optional
        Rows whose entry is false/0 are left exactly as they are; all rows merge when None.

    Returns
    -------
    None

    Example
    -------
    >>> import torch
    >>> from dspec.compat.flashinfer import merge_state_in_place
    >>> v, s = torch.ones(2, 1, 2), torch.zeros(2, 1)
    >>> merge_state_in_place(v, s, torch.zeros(2, 1, 2), torch.zeros(2, 1), mask=torch.tensor([True, False]))
    >>> v[:, 0, 0].tolist(), s[:, 0].tolist()
    ([0.5, 1.0], [1.0, 0.0])
    """
    _pair(("v", "s"), (v, s), ("v_other", "s_other"), (v_other, s_other), s_float32=True)
    if mask is not None:
        _validate.tensor("mask", mask, dim=1, dtypes=_MASK_DTYPES)
        if mask.shape[0] != v.shape[0]:
            raise ValueError(f"mask must have shape [seq_len] = [{v.shape[0]}], got {list(mask.shape)}")
        _validate.same_device(v.device, "v", mask=mask)
    merged_v, merged_s = _merge_base2(v, s, v_other, s_other)
    if mask is None:
        v.copy_(merged_v)
        s.copy_(merged_s)
    else:
        keep = mask.bool()
        v.copy_(torch.where(keep[:, None, None], merged_v, v))
        s.copy_(torch.where(keep[:, None], merged_s, s))


def merge_states(v, s):
    """Merge ``num_states`` attention states per row at once (flashinfer's call; base-2 lse).

    Parameters
    ----------
    v : float32/float16/bfloat16 [seq_len, num_states, num_heads, head_dim]
        Each state's output, normalised over its own keys.
    s : float [seq_len, num_states, num_heads]
        Each state's base-2 log-sum-exp.

    Returns
    -------
    V : [seq_len, num_heads, head_dim] in v's dtype
        The output over the union of all states' keys (accumulated in float32).
    S : float32 [seq_len, num_heads]
        Its base-2 log-sum-exp (-inf, with V = 0, when every state is empty or
        ``num_states`` is 0).

    Example
    -------
    >>> import torch
    >>> from dspec.compat.flashinfer import merge_states
    >>> v = torch.tensor([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    >>> out, lse = merge_states(v, torch.zeros(1, 3, 1))
    >>> round(out.item(), 4), round(lse.item(), 4)
    (2.0, 1.585)
    """
    _state("v", v, "s", s, v_dim=4)
    _validate.same_device(v.device, "v", s=s)
    seq_len, num_states, num_heads, head_dim = v.shape
    if num_states == 0:
        return (
            torch.zeros(seq_len, num_heads, head_dim, dtype=v.dtype, device=v.device),
            torch.full((seq_len, num_heads), -math.inf, dtype=torch.float32, device=v.device),
        )
    # a pairwise tree of dspec merges, log2(num_states) calls, each over all pairs at once
    o, lse = v.float(), s.float() * _LN2
    while True:  # one state still goes through a merge
        if o.shape[1] % 2:  # pad with an empty state
            o = torch.cat([o, o.new_zeros(seq_len, 1, num_heads, head_dim)], dim=1)
            lse = torch.cat([lse, lse.new_full((seq_len, 1, num_heads), -math.inf)], dim=1)
        half = o.shape[1] // 2
        o, lse = _dspec_merge_states(o[:, :half], lse[:, :half], o[:, half:], lse[:, half:])
        if half == 1:
            break
    return o[:, 0].to(v.dtype), lse[:, 0] * _LOG2E

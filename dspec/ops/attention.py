"""cascade_attention and merge_states: shared-prefix attention under a packed suffix mask."""
from __future__ import annotations

import torch

from .. import _backend, _library, _validate
from ..reference import attention as _reference
from ..reference import pack_mask as _pack_reference

_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REFERENCE_DTYPES = _ATTN_DTYPES + (torch.float64,)


def _check_mask(mask, batch: int, n: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    _validate.tensor("mask", mask, dtypes=(torch.int32, torch.bool))
    _validate.same_device(device, "q", mask=mask)
    if mask.dtype == torch.bool:
        if mask.shape[-2:] != (n, n) or mask.dim() not in (2, 3):
            raise ValueError(f"a dense mask must have shape [N, N] or [B, N, N] = [{batch}, {n}, {n}], "
                             f"got {list(mask.shape)}")
        mask = _pack_reference.pack_mask(mask)
    words = (n + 31) // 32
    if mask.dim() not in (2, 3) or mask.shape[-2:] != (n, words) or (mask.dim() == 3 and mask.shape[0] != batch):
        raise ValueError(f"mask must hold packed words of shape [N, ceil(N/32)] or [B, N, ceil(N/32)] = "
                         f"[{batch}, {n}, {words}], got {list(mask.shape)}")
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask


def cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *,
                      prefix_k=None, prefix_v=None, prefix_indptr=None, sm_scale=None,
                      return_lse: bool = False, prefix_page_table=None, prefix_lens=None,
                      max_prefix_len: int | None = None, backend: str | None = None):
    """Attention of N suffix queries over a shared (ragged) prefix plus a masked suffix.

    Parameters
    ----------
    q : [B, N, Hq, D]; k, v : [B, N, Hkv, D] (the suffix's own keys and values), float32 /
        float16 / bfloat16 (float64 on the torch backend), the same dtype; Hq % Hkv == 0
        (query head h uses KV head h // (Hq // Hkv)).
    mask : packed int32 words [N, ceil(N/32)] (shared by the batch) or [B, N, ceil(N/32)];
        bit j of word w of row i lets suffix query i see suffix key 32w + j (see
        ``dspec.pack_mask`` and ``dspec.masks``).  A bool [N, N] / [B, N, N] mask is packed
        for you.  None: every suffix key is visible.
    prefix_k, prefix_v : [T, Hkv, D], every request's prefix back to back; prefix_indptr :
        int [B + 1], request b owns rows ``prefix_indptr[b]:prefix_indptr[b + 1]`` (length 0
        allowed).  Every suffix query sees all of its request's prefix.
    prefix_page_table, prefix_lens : the paged layout engines use, instead of
        ``prefix_indptr``: prefix_k / prefix_v [num_pages, page_size, Hkv, D], the int32
        page table [B, max_pages] (request b's logical row t lives in page
        ``table[b, t // page_size]`` at slot ``t % page_size``) and the lengths [B].
    sm_scale : float, default ``1 / sqrt(D)``.
    return_lse : also return the natural-log logsumexp of the scaled scores [B, N, Hq] float32.
    max_prefix_len : optional upper bound of the prefix lengths; lets the kernel size its
        prefix splits without reading ``prefix_indptr`` on the host (CUDA-graph capture).

    Returns
    -------
    out [B, N, Hq, D] in q's dtype (and lse).  A query that sees no key gets out = 0 and
    lse = -inf.

    Example
    -------
    >>> import torch, dspec
    >>> q = torch.randn(1, 3, 4, 64); k = v = torch.randn(1, 3, 2, 64)
    >>> pk = pv = torch.randn(10, 2, 64)
    >>> causal = dspec.masks.causal(3).words if hasattr(dspec, "masks") else None
    >>> out = dspec.cascade_attention(q, k, v, causal, prefix_k=pk, prefix_v=pv,
    ...                               prefix_indptr=torch.tensor([0, 10]))
    >>> out.shape
    torch.Size([1, 3, 4, 64])
    """
    _validate.tensor("q", q, dim=4, dtypes=_REFERENCE_DTYPES)
    _validate.tensor("k", k, dim=4, dtypes=(q.dtype,))
    _validate.tensor("v", v, dim=4, dtypes=(q.dtype,))
    batch, n, hq, head_dim = q.shape
    device = q.device
    if k.shape != v.shape or k.shape[:2] != (batch, n) or k.shape[3] != head_dim:
        raise ValueError(f"k and v must have shape [B, N, Hkv, D] = [{batch}, {n}, Hkv, {head_dim}], "
                         f"got {list(k.shape)} and {list(v.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    _validate.same_device(device, "q", k=k, v=v)
    mask = _check_mask(mask, batch, n, device)
    paged = prefix_page_table is not None or prefix_lens is not None
    if paged:
        _check_paged_prefix(prefix_k, prefix_v, prefix_indptr, prefix_page_table, prefix_lens,
                            batch, hkv, head_dim, q.dtype, device)
    else:
        prefix_k, prefix_v = _check_ragged_prefix(prefix_k, prefix_v, prefix_indptr, batch, hkv,
                                                  head_dim, q.dtype, device)
    if sm_scale is not None:
        sm_scale = float(sm_scale)
    name = _library.resolve("cascade_attention", backend, device, ("torch", "triton"))
    if name == "triton" and q.dtype == torch.float64:
        raise ValueError("cascade_attention: the Triton kernel takes float32/float16/bfloat16, got float64")
    if max_prefix_len is not None and (isinstance(max_prefix_len, bool) or not isinstance(max_prefix_len, int)
                                       or max_prefix_len < 0):
        raise ValueError(f"max_prefix_len must be None or an int >= 0, got {max_prefix_len!r}")
    args = (q, k, v, mask, prefix_k, prefix_v, prefix_indptr, prefix_page_table, prefix_lens,
            sm_scale, bool(return_lse), max_prefix_len, name)
    if _library.call_directly(q, k, v, mask, prefix_k, prefix_v, prefix_indptr, prefix_page_table,
                              prefix_lens):
        return _cascade_attention_impl(*args)
    out, lse = _library.cascade_attention(*args)
    return (out, lse) if return_lse else out


def _cascade_attention_impl(q, k, v, mask, prefix_k, prefix_v, prefix_indptr, prefix_page_table,
                            prefix_lens, sm_scale, return_lse, max_prefix_len, name):
    """Body of the ``dspec::cascade_attention`` custom op: run backend ``name`` on checked
    inputs; returns ``out`` or ``(out, lse)`` as ``return_lse`` asks."""
    paged = prefix_page_table is not None
    if name == "torch":
        if paged:
            prefix_k, prefix_v, prefix_indptr = _reference.gather_pages(
                prefix_k, prefix_v, prefix_page_table, prefix_lens)
        return _reference.cascade_attention(q, k, v, mask, prefix_k=prefix_k, prefix_v=prefix_v,
                                            prefix_indptr=prefix_indptr, sm_scale=sm_scale,
                                            return_lse=return_lse)
    from ..kernels.cascade_attention import cascade_attention_triton
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return cascade_attention_triton(
        q, k, v, mask, prefix_k, prefix_v,
        None if prefix_indptr is None else prefix_indptr.contiguous(), sm_scale, return_lse,
        prefix_page_table=None if not paged else prefix_page_table.contiguous(),
        prefix_lens=None if not paged else prefix_lens.contiguous(), max_prefix_len=max_prefix_len)


def _check_ragged_prefix(prefix_k, prefix_v, prefix_indptr, batch, hkv, head_dim, dtype, device):
    if (prefix_k is None) != (prefix_v is None) or (prefix_k is None) != (prefix_indptr is None):
        raise ValueError("prefix_k, prefix_v and prefix_indptr must be given together")
    if prefix_k is None:
        return None, None
    _validate.tensor("prefix_k", prefix_k, dim=3, dtypes=(dtype,))
    _validate.tensor("prefix_v", prefix_v, dim=3, dtypes=(dtype,))
    _validate.tensor("prefix_indptr", prefix_indptr, dim=1, dtypes=_validate.ID_DTYPES)
    if prefix_k.shape != prefix_v.shape or prefix_k.shape[1:] != (hkv, head_dim):
        raise ValueError(f"prefix_k and prefix_v must have shape [T, Hkv, D] = [T, {hkv}, {head_dim}], "
                         f"got {list(prefix_k.shape)} and {list(prefix_v.shape)}")
    if prefix_indptr.shape[0] != batch + 1:
        raise ValueError(f"prefix_indptr must have B + 1 = {batch + 1} entries, got {prefix_indptr.shape[0]}")
    _validate.same_device(device, "q", prefix_k=prefix_k, prefix_v=prefix_v, prefix_indptr=prefix_indptr)
    if _validate.value_checks_enabled(prefix_indptr):
        ip = prefix_indptr.long()
        if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()) or int(ip[-1]) > prefix_k.shape[0]:
            raise ValueError(f"prefix_indptr must start at 0, never decrease and end at most at "
                             f"T = {prefix_k.shape[0]}; got {ip.tolist()[:16]}")
    if prefix_k.stride(-1) != 1 or prefix_v.stride(-1) != 1:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    return prefix_k, prefix_v


def _check_paged_prefix(prefix_k, prefix_v, prefix_indptr, table, lens, batch, hkv, head_dim,
                        dtype, device):
    if prefix_indptr is not None:
        raise ValueError("give either prefix_indptr (ragged) or prefix_page_table + prefix_lens (paged)")
    if prefix_k is None or prefix_v is None or table is None or lens is None:
        raise ValueError("a paged prefix needs prefix_k, prefix_v, prefix_page_table and prefix_lens")
    _validate.tensor("prefix_k", prefix_k, dim=4, dtypes=(dtype,))
    _validate.tensor("prefix_v", prefix_v, dim=4, dtypes=(dtype,))
    _validate.tensor("prefix_page_table", table, dim=2, dtypes=(torch.int32,))
    _validate.tensor("prefix_lens", lens, dim=1, dtypes=(torch.int32,))
    if prefix_k.shape != prefix_v.shape or prefix_k.shape[2:] != (hkv, head_dim):
        raise ValueError(f"paged prefix_k and prefix_v must have shape [pages, page_size, Hkv, D] = "
                         f"[P, S, {hkv}, {head_dim}], got {list(prefix_k.shape)} and {list(prefix_v.shape)}")
    if prefix_k.stride(-1) != 1 or prefix_v.stride(-1) != 1:
        raise ValueError("paged prefix_k / prefix_v must be contiguous along D")
    if table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(f"prefix_page_table [B, max_pages] and prefix_lens [B] need B = {batch}, "
                         f"got {list(table.shape)} and {list(lens.shape)}")
    _validate.same_device(device, "q", prefix_k=prefix_k, prefix_v=prefix_v, prefix_page_table=table,
                          prefix_lens=lens)
    if batch and _validate.value_checks_enabled(lens):
        page_size, pages = prefix_k.shape[1], prefix_k.shape[0]
        if bool((lens < 0).any()) or int(lens.max()) > table.shape[1] * page_size:
            raise ValueError(f"prefix_lens must lie in [0, max_pages * page_size] = "
                             f"[0, {table.shape[1] * page_size}], got {lens.tolist()[:16]}")
        used = torch.arange(table.shape[1], device=device)[None, :] * page_size < lens[:, None]
        bad = used & ((table < 0) | (table >= pages))
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(f"prefix_page_table[{b}, {i}] = {int(table[b, i])} is not a page in [0, {pages})")


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                 *, backend: str | None = None):
    """Combine two partial attention results over disjoint key sets.

    Parameters
    ----------
    o_a, o_b : [..., D] float32/float16/bfloat16, each normalised over its own keys.
    lse_a, lse_b : [...] float32, natural-log logsumexp of each part's scaled scores.

    Returns
    -------
    (o [..., D] in o_a's dtype, lse [...] float32): ``o = (e^{lse_a} o_a + e^{lse_b} o_b) /
    (e^{lse_a} + e^{lse_b})``; two empty states (lse = -inf) give o = 0, lse = -inf.

    Example
    -------
    >>> import torch, dspec
    >>> o, lse = dspec.merge_states(torch.ones(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(2))
    >>> o[0].tolist(), round(lse[0].item(), 4)
    ([0.5, 0.5, 0.5, 0.5], 0.6931)
    """
    _validate.tensor("o_a", o_a, min_dim=1, dtypes=_ATTN_DTYPES)
    _validate.tensor("o_b", o_b, min_dim=1, dtypes=(o_a.dtype,))
    _validate.tensor("lse_a", lse_a, dtypes=(torch.float32,))
    _validate.tensor("lse_b", lse_b, dtypes=(torch.float32,))
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {list(o_a.shape)} and {list(o_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != o_a.shape[:-1]:
            raise ValueError(f"{name} must have shape o.shape[:-1] = {list(o_a.shape[:-1])}, got {list(t.shape)}")
    _validate.same_device(o_a.device, "o_a", o_b=o_b, lse_a=lse_a, lse_b=lse_b)
    name = _library.resolve("merge_states", backend, o_a.device, ("torch", "triton", "cuda", "cpp"))
    if _library.call_directly(o_a, lse_a, o_b, lse_b):
        return _merge_states_impl(o_a, lse_a, o_b, lse_b, name)
    return _library.merge_states(o_a, lse_a, o_b, lse_b, name)


def _merge_states_impl(o_a, lse_a, o_b, lse_b, name):
    """Body of the ``dspec::merge_states`` custom op: run backend ``name``."""
    if name == "torch":
        return _reference.merge_states(o_a, lse_a, o_b, lse_b)
    if name == "triton":
        from ..kernels.cascade_attention import merge_states_triton
        return merge_states_triton(o_a, lse_a, o_b, lse_b)
    return _merge_states_ext(o_a, lse_a, o_b, lse_b, cuda=name == "cuda")


def _merge_states_ext(o_a, lse_a, o_b, lse_b, *, cuda: bool):
    head_dim = o_a.shape[-1]
    rows = lse_a.numel()
    oa, ob = (t.reshape(rows, head_dim).contiguous() for t in (o_a, o_b))
    la, lb = (t.reshape(rows).contiguous() for t in (lse_a, lse_b))
    out = torch.empty_like(oa)
    lse = torch.empty(rows, dtype=torch.float32, device=o_a.device)
    stream = _backend.cuda_stream(o_a.device, cuda)
    with _backend.launch_context(o_a.device, cuda):
        _backend.extension().merge_states(
            oa.data_ptr(), la.data_ptr(), ob.data_ptr(), lb.data_ptr(), out.data_ptr(),
            lse.data_ptr(), _backend.FLOAT_CODE[oa.dtype], rows, head_dim, "cuda" if cuda else "cpu", stream)
    return out.reshape(o_a.shape), lse.reshape(lse_a.shape)

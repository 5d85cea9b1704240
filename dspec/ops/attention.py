"""cascade_attention and merge_states: shared-prefix attention under a packed suffix mask."""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import _backend, _library, _validate, cpu
from ..reference import attention as _reference, pack_mask as _pack_reference
from . import masks as _masks

_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REFERENCE_DTYPES = _ATTN_DTYPES + (torch.float64,)
_CASCADE_BACKENDS = ("torch", "triton", "cpp")
# Tile code of the "cpp" backend: "auto" (AVX-512 where the CPU has it), "generic" (the
# portable loops) or "avx512"; the tests pin "generic" to cover both.
CPP_ISA = "auto"
# Without SIMD tiles (DSPEC_CPU_ISA=generic, or a CPU without AVX2) the portable loops lose to
# torch's fused attention (F.scaled_dot_product_attention) past GENERIC_CPP_MAX_ROWS suffix
# rows, so an inference call with the default backend runs the "sdpa" route there
# (_SdpaLayout); an explicit backend="cpp" still runs them, and backend="torch" the
# reference.  Measured per layer, SmolLM2-135M's heads after 256 cached tokens, one thread,
# AMD EPYC (Zen 3) at DSPEC_CPU_ISA=generic (docs/performance.md): the loops take 0.71 /
# 0.25x SDPA's time at N = 1 (fp32 / bf16), 1.49 / 1.26x at N = 4, 3.0 / 2.6x at N = 16.
GENERIC_CPP_MAX_ROWS = 2
_Tensor = torch.Tensor


def _check_mask(mask, batch: int, n: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    _validate.tensor("mask", mask, dtypes=(torch.int32, torch.bool))
    _validate.same_device(device, "q", mask=mask)
    if mask.dtype == torch.bool:
        if mask.shape[-2:] != (n, n) or mask.dim() not in (2, 3):
            raise ValueError(
                f"a dense mask must have shape [N, N] or [B, N, N] = [{batch}, {n}, {n}], got {list(mask.shape)}"
            )
        mask = _masks.pack_mask(mask)
    words = (n + 31) // 32
    if mask.dim() not in (2, 3) or mask.shape[-2:] != (n, words) or (mask.dim() == 3 and mask.shape[0] != batch):
        raise ValueError(
            f"mask must hold packed words of shape [N, ceil(N/32)] or [B, N, ceil(N/32)] = "
            f"[{batch}, {n}, {words}], got {list(mask.shape)}"
        )
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask


def cascade_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    prefix_k=None,
    prefix_v=None,
    prefix_indptr=None,
    sm_scale=None,
    return_lse: bool = False,
    prefix_page_table=None,
    prefix_lens=None,
    max_prefix_len: int | None = None,
    backend: str | None = None,
    suffix_indptr=None,
):
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
    backend : "torch" (the reference), "triton", "cpp" (the C++ CPU code of ``dspec._C``:
        float32 / float16 / bfloat16 CPU tensors, no backward) or "auto" (default; see
        ``dspec._backend``: on CPU tensors the C++ code, except for float64 and calls that
        autograd records, which run the reference).  For many calls with the same shapes,
        mask and prefix layout (one per layer of a forward) see :class:`CascadeAttentionPlan`.
    suffix_indptr : optional int32 / int64 [B + 1], ragged suffixes: request b owns the
        rows ``suffix_indptr[b]:suffix_indptr[b + 1]`` (length 0 allowed) of q [T, Hq, D]
        and k, v [T, Hkv, D], T = ``suffix_indptr[B]``.  ``mask`` is then packed int32
        words [T, ceil(max_n / 32)] (max_n the longest suffix): bit j of row t of request
        b lets t see b's suffix key j; bits at or past b's length are ignored.  None:
        every query sees all of its request's suffix keys.  The prefix arguments keep
        their meaning per request b.  The result equals B separate calls, one per
        request; the suffixes are padded to [B, max_n] rows for one batched call and the
        real rows gathered back.  ``suffix_indptr`` is read once on the host (for max_n).

    Returns
    -------
    out [B, N, Hq, D] in q's dtype (and lse); with ``suffix_indptr``: out [T, Hq, D] (and
    lse [T, Hq]).  A query that sees no key gets out = 0 and lse = -inf.

    Notes
    -----
    The "cpp" backend is position-invariant: it tiles a request's keys -- prefix rows, then
    suffix keys -- at fixed key indices, so a query's bits depend only on the keys it sees
    and their indices, not on where the prefix ends, N, the batch or the thread count.  A
    causal chain of N tokens then gives, row for row, exactly the result of N one-token
    calls with the earlier tokens cached: greedy chain verification equals one-token
    decoding in bf16 as in fp32.  A row whose visible suffix keys are not the first k of
    the suffix (a tree node, an SSD copy) is compacted: it gets the bits of the call that
    gives it only those keys, in order, as an all-visible suffix -- so tree and copy
    layouts verify exactly as chains do.

    On CPU tensors, a call that repeats the previous call's packed int32 ``mask`` and prefix
    metadata (the same contiguous tensors, unchanged or changed in place) runs through a
    cached :class:`CascadeAttentionPlan` from its second occurrence on: the same kernel and
    bits without the Python validation; the tensors' values are still read at each call.

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

    Ragged suffixes: two requests with 2 and 3 suffix rows, 4 and 6 prefix rows.

    >>> q = torch.randn(5, 4, 64); k = v = torch.randn(5, 2, 64)
    >>> out, lse = dspec.cascade_attention(q, k, v, prefix_k=pk, prefix_v=pv,
    ...     prefix_indptr=torch.tensor([0, 4, 10]), return_lse=True,
    ...     suffix_indptr=torch.tensor([0, 2, 5], dtype=torch.int32))
    >>> out.shape, lse.shape
    (torch.Size([5, 4, 64]), torch.Size([5, 4]))
    """
    if suffix_indptr is not None:
        return _ragged_cascade_attention(
            q,
            k,
            v,
            mask,
            suffix_indptr,
            prefix_k,
            prefix_v,
            prefix_indptr,
            sm_scale,
            return_lse,
            prefix_page_table,
            prefix_lens,
            max_prefix_len,
            backend,
        )
    metadata = (mask, prefix_indptr, prefix_page_table, prefix_lens)
    key = _one_call_key(q, k, v, metadata, prefix_k, prefix_v, sm_scale, return_lse, max_prefix_len, backend)
    if key is not None:
        plan = _cached_plan(key, metadata)
        if plan is not None:
            return plan.run(q, k, v, prefix_k, prefix_v, return_lse=return_lse)
    _validate.tensor("q", q, dim=4, dtypes=_REFERENCE_DTYPES)
    _validate.tensor("k", k, dim=4, dtypes=(q.dtype,))
    _validate.tensor("v", v, dim=4, dtypes=(q.dtype,))
    batch, n, hq, head_dim = q.shape
    device = q.device
    if hq == 0 or head_dim == 0:
        raise ValueError(
            f"q must have at least one head and a head dim D >= 1 (shape [B, N, Hq, D]), got {list(q.shape)}"
        )
    if k.shape != v.shape or k.shape[:2] != (batch, n) or k.shape[3] != head_dim:
        raise ValueError(
            f"k and v must have shape [B, N, Hkv, D] = [{batch}, {n}, Hkv, {head_dim}], "
            f"got {list(k.shape)} and {list(v.shape)}"
        )
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    _validate.same_device(device, "q", k=k, v=v)
    mask = _check_mask(mask, batch, n, device)
    paged = prefix_page_table is not None or prefix_lens is not None
    if paged:
        _check_paged_prefix(
            prefix_k, prefix_v, prefix_indptr, prefix_page_table, prefix_lens, batch, hkv, head_dim, q.dtype, device
        )
    else:
        prefix_k, prefix_v = _check_ragged_prefix(
            prefix_k, prefix_v, prefix_indptr, batch, hkv, head_dim, q.dtype, device
        )
    sm_scale = _sm_scale(sm_scale)
    return_lse = _validate.flag("return_lse", return_lse)
    name = backend_for_rows(
        resolve_backend(backend, device, q.dtype, _needs_grad(q, k, v, prefix_k, prefix_v)), backend, n, return_lse
    )
    _check_max_prefix_len(max_prefix_len)
    if key is not None and name == "cpp":
        _store_plan(key, metadata, q, hkv, mask, prefix_indptr, prefix_page_table, prefix_lens, sm_scale)
    return _launch(
        q,
        k,
        v,
        mask,
        prefix_k,
        prefix_v,
        prefix_indptr,
        prefix_page_table,
        prefix_lens,
        sm_scale,
        return_lse,
        max_prefix_len,
        name,
    )


# One-shot calls on plain CPU tensors that repeat their metadata -- the same packed int32 mask
# (or none), prefix_indptr / page table and lengths: the same contiguous objects at the same
# ``_version`` -- run, from the second such call on, through a CascadeAttentionPlan made
# after that call's full validation.  The plan holds those very tensors (no copy: their
# values are read at each call, and the C++ kernel checks the prefix metadata against the
# rows it is given), skips the Python validation (~0.1 ms a call on a 2-core AVX2 EPYC,
# bench/results/cpu/avx2/dispatch_zen3.json) and calls the same kernel: the same bits.
# A dense bool mask is packed into a new tensor by every call and never takes the cache.  At
# most _ONE_CALL_PLANS_MAX plans (and as many keys seen once), the oldest dropped first.
_ONE_CALL_PLANS: dict = {}
_ONE_CALL_SEEN: dict = {}
_ONE_CALL_PLANS_MAX = 16


def _eager_cpu(tensors) -> bool:
    """An eager call on plain CPU tensors: no subclass, no dispatch mode, nothing traced and
    nothing for autograd to record (the checks the one-shot plan cache and a plan's "sdpa"
    route share; ``CascadeAttentionPlan.run`` spells them out for its hot path)."""
    if any(type(t) is not _Tensor or not t.is_cpu for t in tensors):
        return False
    if _get_current_dispatch_mode() is not None or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _one_call_key(q, k, v, metadata, prefix_k, prefix_v, sm_scale, return_lse, max_prefix_len, backend):
    """The plan cache's key of a one-shot call, or None where the call must take the full path:
    a backend named, anything not a plain CPU tensor, tracing, autograd, a CUDA-graph bound."""
    # tracing first: a traced call takes the custom op (and dynamo cannot trace the checks below)
    if torch.compiler.is_compiling():
        return None
    if backend is not None or max_prefix_len is not None or not isinstance(return_lse, bool):
        return None
    tensors = (q, k, v) if prefix_k is None and prefix_v is None else (q, k, v, prefix_k, prefix_v)
    if not _eager_cpu(tensors):
        return None
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))):
        return None
    if metadata[0] is not None and (type(metadata[0]) is not _Tensor or metadata[0].dtype != torch.int32):
        return None
    meta = []
    for t in metadata:
        if t is None:
            meta.append(None)
            continue
        if type(t) is not _Tensor or not t.is_cpu or not t.is_contiguous():
            return None
        meta.append((id(t), t._version, t.data_ptr(), t.dtype, t.shape))
    shapes = tuple((t.shape, t.dtype) for t in tensors)
    return (shapes, *meta, sm_scale, return_lse, os.environ.get("DSPEC_BACKEND"), cpu.isa_epoch())


def _same_objects(refs, metadata) -> bool:
    return all((r is None) == (t is None) and (r is None or r() is t) for r, t in zip(refs, metadata))


def _cached_plan(key, metadata):
    """The cached plan of ``key`` whose metadata tensors are still these very objects."""
    hit = _ONE_CALL_PLANS.get(key)
    if hit is None or not _same_objects(hit[0], metadata):
        return None
    return hit[1]


def _bounded_put(cache: dict, key, value) -> None:
    cache.pop(key, None)
    while len(cache) >= _ONE_CALL_PLANS_MAX:
        cache.pop(next(iter(cache)), None)
    cache[key] = value


def _store_plan(key, metadata, q, hkv, mask, prefix_indptr, prefix_page_table, prefix_lens, sm_scale) -> None:
    """After a validated call of ``key`` (``mask`` the packed words): remember the key the
    first time, make and cache its plan the second."""
    refs = tuple(None if t is None else weakref.ref(t) for t in metadata)
    seen = _ONE_CALL_SEEN.get(key)
    if seen is None or not _same_objects(seen, metadata):
        _bounded_put(_ONE_CALL_SEEN, key, refs)
        return
    _ONE_CALL_SEEN.pop(key, None)
    batch, n, hq, head_dim = q.shape
    plan = CascadeAttentionPlan(
        batch,
        n,
        hq,
        hkv,
        head_dim,
        q.dtype,
        "cpu",
        mask,
        prefix_page_table=prefix_page_table,
        prefix_lens=prefix_lens,
        prefix_indptr=prefix_indptr,
        sm_scale=sm_scale,
    )
    if plan.backend == "cpp" and plan._meta is not None:
        _bounded_put(_ONE_CALL_PLANS, key, (refs, plan))


class _RaggedLayout:
    """Ragged suffixes [T, ...] <-> the padded batch [B, max_n, ...] of the batched kernels.

    Built from a checked ``suffix_indptr`` (read once on the host for B, T and max_n); the
    index tensors come from torch ops, so padding and gathering cost one ``index_copy`` /
    ``index_select`` each.  Padded rows get zero queries / keys and a zero mask row (they
    see no suffix key; their outputs are discarded), and every real row's mask is cut to
    its request's suffix length so no padded key is ever visible.
    """

    __slots__ = ("batch", "total", "max_n", "words", "flat", "valid")

    def __init__(self, suffix_indptr: torch.Tensor, device):
        bounds = suffix_indptr.tolist()
        self.batch, self.total = len(bounds) - 1, bounds[-1]
        ip = suffix_indptr.to(device=device, dtype=torch.int64)
        lens = ip[1:] - ip[:-1]
        self.max_n = max((bounds[b + 1] - bounds[b] for b in range(self.batch)), default=0)
        self.words = (self.max_n + 31) // 32
        request = torch.repeat_interleave(torch.arange(self.batch, device=device), lens, output_size=self.total)
        row = torch.arange(self.total, device=device) - ip[request]
        self.flat = request * self.max_n + row  # row t's place in [B * max_n]
        # request b's visible-key words: bits j < len_b
        count = (lens[:, None] - 32 * torch.arange(self.words, device=device)[None, :]).clamp(0, 32)
        value = torch.where(count >= 32, torch.full_like(count, (1 << 32) - 1), (1 << count) - 1)
        value = torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)
        self.valid = value[request]  # [T, W]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, max_n, ...], zeros in the padded rows."""
        full = x.new_zeros((self.batch * self.max_n,) + tuple(x.shape[1:]))
        return full.index_copy(0, self.flat, x).view((self.batch, self.max_n) + tuple(x.shape[1:]))

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """[B, max_n, ...] -> the real rows [T, ...]."""
        return y.reshape((self.batch * self.max_n,) + tuple(y.shape[2:])).index_select(0, self.flat)

    def mask(self, mask) -> torch.Tensor:
        """The padded packed mask [B, max_n, W] of a checked ragged mask [T, W] (None: all of
        a request's suffix keys)."""
        words = self.valid if mask is None else mask & self.valid
        return self.pad(words)


def _check_suffix_indptr(suffix_indptr, total: int, device) -> None:
    _validate.tensor("suffix_indptr", suffix_indptr, dim=1, dtypes=_validate.ID_DTYPES)
    if suffix_indptr.shape[0] < 1:
        raise ValueError("suffix_indptr must have B + 1 >= 1 entries, got 0")
    _validate.same_device(device, "q", suffix_indptr=suffix_indptr)
    ip = suffix_indptr.long()
    if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()) or int(ip[-1]) != total:
        raise ValueError(
            f"suffix_indptr must start at 0, never decrease and end at T = {total} "
            f"(the rows of q); got {ip.tolist()[:16]}"
        )


def _check_ragged_mask(mask, layout: _RaggedLayout, device):
    if mask is None:
        return None
    _validate.tensor("mask", mask, dim=2, dtypes=(torch.int32,))
    _validate.same_device(device, "q", mask=mask)
    if mask.shape != (layout.total, layout.words):
        raise ValueError(
            f"with suffix_indptr, mask must hold packed int32 words of shape "
            f"[T, ceil(max_n/32)] = [{layout.total}, {layout.words}], got {list(mask.shape)}"
        )
    return mask


def _ragged_cascade_attention(
    q,
    k,
    v,
    mask,
    suffix_indptr,
    prefix_k,
    prefix_v,
    prefix_indptr,
    sm_scale,
    return_lse,
    prefix_page_table,
    prefix_lens,
    max_prefix_len,
    backend,
):
    """cascade_attention with ragged suffixes: check, pad to one batched call, gather back."""
    _validate.tensor("q", q, dim=3, dtypes=_REFERENCE_DTYPES)
    _validate.tensor("k", k, dim=3, dtypes=(q.dtype,))
    _validate.tensor("v", v, dim=3, dtypes=(q.dtype,))
    total, hq, head_dim = q.shape
    if hq == 0 or head_dim == 0:
        raise ValueError(f"q must have at least one head and a head dim D >= 1 (shape [T, Hq, D]), got {list(q.shape)}")
    if k.shape != v.shape or k.shape[0] != total or k.shape[2] != head_dim:
        raise ValueError(
            f"with suffix_indptr, k and v must have shape [T, Hkv, D] = [{total}, Hkv, {head_dim}], "
            f"got {list(k.shape)} and {list(v.shape)}"
        )
    _validate.same_device(q.device, "q", k=k, v=v)
    _check_suffix_indptr(suffix_indptr, total, q.device)
    layout = _RaggedLayout(suffix_indptr, q.device)
    mask = _check_ragged_mask(mask, layout, q.device)
    return_lse = _validate.flag("return_lse", return_lse)
    result = cascade_attention(
        layout.pad(q),
        layout.pad(k),
        layout.pad(v),
        layout.mask(mask),
        prefix_k=prefix_k,
        prefix_v=prefix_v,
        prefix_indptr=prefix_indptr,
        sm_scale=sm_scale,
        return_lse=return_lse,
        prefix_page_table=prefix_page_table,
        prefix_lens=prefix_lens,
        max_prefix_len=max_prefix_len,
        backend=backend,
    )
    if return_lse:
        return layout.gather(result[0]), layout.gather(result[1])
    return layout.gather(result)


def _sm_scale(sm_scale) -> float | None:
    """None (1 / sqrt(D)) or a finite real number: every backend takes the same values (a
    NaN or an infinite scale has no meaningful softmax)."""
    return None if sm_scale is None else _validate.finite("sm_scale", sm_scale)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def resolve_backend(backend, device, dtype, needs_grad: bool) -> str:
    """The backend name.  The C++ code takes no float64 and has no backward: "auto" (and a
    ``$DSPEC_BACKEND`` preference) then runs the torch reference, as before the C++ code
    existed; an explicit ``backend="cpp"`` is an error."""
    unsupported = {}
    if dtype == torch.float64:
        unsupported["cpp"] = "the 'cpp' backend takes float32/float16/bfloat16, got float64"
    elif needs_grad:
        unsupported["cpp"] = "the 'cpp' backend has no backward (an input requires grad); use backend='torch'"
    name = _library.resolve("cascade_attention", backend, device, _CASCADE_BACKENDS, unsupported)
    if name == "triton" and dtype == torch.float64:
        raise ValueError("cascade_attention: the Triton kernel takes float32/float16/bfloat16, got float64")
    return name


def backend_for_rows(name: str, backend, n: int, return_lse: bool = False) -> str:
    """The default backend for ``n`` suffix rows: "cpp" yields to the "sdpa" route (torch's
    fused attention) where only the portable loops would run and ``n`` exceeds
    :data:`GENERIC_CPP_MAX_ROWS` (measured); to the torch reference when the call needs the
    lse, which SDPA does not return."""
    if name == "cpp" and backend in (None, "auto") and n > GENERIC_CPP_MAX_ROWS and cpu.generic_level():
        return "torch" if return_lse else "sdpa"
    return name


def _check_max_prefix_len(max_prefix_len) -> None:
    if max_prefix_len is not None and (
        isinstance(max_prefix_len, bool) or not isinstance(max_prefix_len, int) or max_prefix_len < 0
    ):
        raise ValueError(f"max_prefix_len must be None or an int >= 0, got {max_prefix_len!r}")


def _launch(
    q,
    k,
    v,
    mask,
    prefix_k,
    prefix_v,
    prefix_indptr,
    prefix_page_table,
    prefix_lens,
    sm_scale,
    return_lse,
    max_prefix_len,
    name,
):
    """Run checked inputs on backend ``name``: the op's body in a plain eager call, else the
    ``dspec::cascade_attention`` custom op (tracing, dispatch modes, tensor subclasses)."""
    args = (
        q,
        k,
        v,
        mask,
        prefix_k,
        prefix_v,
        prefix_indptr,
        prefix_page_table,
        prefix_lens,
        sm_scale,
        return_lse,
        max_prefix_len,
        name,
    )
    if _library.call_directly(q, k, v, mask, prefix_k, prefix_v, prefix_indptr, prefix_page_table, prefix_lens):
        return _cascade_attention_impl(*args)
    out, lse = _library.cascade_attention(*args)
    return (out, lse) if return_lse else out


@_library.body('cascade_attention')
def _cascade_attention_impl(
    q,
    k,
    v,
    mask,
    prefix_k,
    prefix_v,
    prefix_indptr,
    prefix_page_table,
    prefix_lens,
    sm_scale,
    return_lse,
    max_prefix_len,
    name,
):
    """Body of the ``dspec::cascade_attention`` custom op: run backend ``name`` on checked
    inputs; returns ``out`` or ``(out, lse)`` as ``return_lse`` asks."""
    paged = prefix_page_table is not None
    if name == "cpp":
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        meta = _CppMeta(
            q.shape[0],
            q.shape[1],
            q.shape[2],
            k.shape[2],
            q.shape[3],
            q.dtype,
            mask,
            prefix_indptr,
            prefix_page_table,
            prefix_lens,
            sm_scale,
            prefix_k is not None,
        )
        return _cpp_run(meta, q, k, v, prefix_k, prefix_v, return_lse)
    if name == "sdpa" and not return_lse:
        layout = _SdpaLayout(mask, q.shape[0], q.shape[1], prefix_indptr, prefix_page_table, prefix_lens, q.device)
        return layout.run(q, k, v, prefix_k, prefix_v, sm_scale)
    if name in ("torch", "sdpa"):  # the "sdpa" route's lse comes from the reference
        if paged:
            prefix_k, prefix_v, prefix_indptr = _reference.gather_pages(
                prefix_k, prefix_v, prefix_page_table, prefix_lens
            )
        return _reference.cascade_attention(
            q,
            k,
            v,
            mask,
            prefix_k=prefix_k,
            prefix_v=prefix_v,
            prefix_indptr=prefix_indptr,
            sm_scale=sm_scale,
            return_lse=return_lse,
        )
    from ..kernels.cascade_attention import cascade_attention_triton

    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return cascade_attention_triton(
        q,
        k,
        v,
        mask,
        prefix_k,
        prefix_v,
        None if prefix_indptr is None else prefix_indptr.contiguous(),
        sm_scale,
        return_lse,
        prefix_page_table=None if not paged else prefix_page_table.contiguous(),
        prefix_lens=None if not paged else prefix_lens.contiguous(),
        max_prefix_len=max_prefix_len,
    )


class _SdpaLayout:
    """The "sdpa" route's per-request layout, prepared once (a plan keeps it for all its
    layers): each request's boolean mask over its [prefix | suffix] keys, its queries that
    see no key, and where its prefix rows lie (a span of a ragged prefix, the first rows of
    one page, or a gather over its pages).

    The route runs, per request, ``F.scaled_dot_product_attention`` over the request's keys
    (grouped-query heads by ``enable_gqa``) and gives a query that sees no key the
    reference's 0.  The lse comes from the reference (SDPA does not return it)."""

    __slots__ = ("requests",)

    def __init__(self, mask, batch: int, n: int, prefix_indptr, prefix_page_table, prefix_lens, device):
        dense = None
        if mask is not None:
            dense = _pack_reference.unpack_mask(mask, n) if mask.dtype != torch.bool else mask
        if prefix_page_table is not None:
            lens = prefix_lens.tolist()
        elif prefix_indptr is not None:
            bounds = prefix_indptr.tolist()
            lens = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        else:
            lens = [0] * batch
        self.requests = []
        for b in range(batch):
            plen = lens[b]
            visible = None if dense is None else (dense if dense.dim() == 2 else dense[b])
            blind = None
            if visible is not None and plen == 0:
                rows = ~visible.any(-1)
                blind = rows if bool(rows.any()) else None
            if visible is not None and plen:
                visible = torch.cat([torch.ones(n, plen, dtype=torch.bool, device=device), visible], 1)
            if prefix_page_table is not None and plen:
                rows_at = (int(prefix_page_table[b, 0]), prefix_page_table[b].long())
            elif prefix_indptr is not None and plen:
                rows_at = slice(bounds[b], bounds[b + 1])
            else:
                rows_at = None
            self.requests.append((visible, blind, rows_at, plen))

    def run(self, q, k, v, prefix_k, prefix_v, sm_scale):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        gqa = q.shape[2] != k.shape[2]
        for b, (visible, blind, rows_at, plen) in enumerate(self.requests):
            keys, values = k[b], v[b]
            if rows_at is not None:
                if isinstance(rows_at, slice):
                    pk, pv = prefix_k[rows_at], prefix_v[rows_at]
                elif plen <= prefix_k.shape[1]:  # the first plen rows of one page: views
                    pk, pv = prefix_k[rows_at[0], :plen], prefix_v[rows_at[0], :plen]
                else:
                    page_size = prefix_k.shape[1]
                    t = torch.arange(plen, device=q.device)
                    at = (rows_at[1][t // page_size], t % page_size)
                    pk, pv = prefix_k[at], prefix_v[at]
                keys, values = torch.cat([pk, keys]), torch.cat([pv, values])
            # [1, H, L, D]: the 4-D form takes the CPU's fused kernel (3-D inputs the math path)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[b].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=visible,
                scale=sm_scale,
                enable_gqa=gqa,
            )[0].transpose(0, 1)
            if blind is not None:
                o = o.masked_fill(blind[:, None, None], 0.0)
            out[b] = o
        return out


class _CppMeta:
    """The layer-independent arguments of ``dspec._C.cascade_attention``: sizes, the mask
    and prefix metadata (contiguous, kept alive here) and their addresses / strides."""

    __slots__ = ("ext", "head", "out_shape", "lse_shape", "out_strides", "mask_part", "meta_part", "prefix", "keep")

    def __init__(self, batch, n, hq, hkv, head_dim, dtype, mask, indptr, table, lens, sm_scale, has_prefix: bool):
        self.ext = _backend.extension()
        scale = float(sm_scale) if sm_scale is not None else head_dim**-0.5
        self.head = (_backend.FLOAT_CODE[dtype], batch, n, hq, hkv, head_dim, scale)
        self.out_shape = (batch, n, hq, head_dim)
        self.lse_shape = (batch, n, hq)
        self.out_strides = (n * hq * head_dim, hq * head_dim, head_dim)
        if mask is not None:
            mask = mask if mask.stride(-1) == 1 else mask.contiguous()
            self.mask_part = (mask.data_ptr(), 0 if mask.dim() == 2 else mask.stride(0), mask.stride(-2))
        else:
            self.mask_part = (0, 0, 0)
        if not has_prefix:
            self.prefix = 0
            indptr = table = lens = None
            self.meta_part = (0, 0, 0, 0, 0, 0)  # ptrs, indptr code, max_pages, table stride
        elif table is not None:
            self.prefix = 2
            table, lens = table.contiguous(), lens.contiguous()
            self.meta_part = (0, table.data_ptr(), lens.data_ptr(), 0, table.shape[1], table.shape[1])
        else:
            self.prefix = 1
            indptr = indptr.contiguous()
            self.meta_part = (indptr.data_ptr(), 0, 0, _backend.ID_CODE[indptr.dtype], 0, 0)
        self.keep = (mask, indptr, table, lens)


def _cpp_run(
    meta: _CppMeta, q, k, v, prefix_k, prefix_v, return_lse: bool, qs=None, ks=None, vs=None, pks=None, pvs=None
):
    """dspec._C.cascade_attention on CPU tensors with a unit stride along D (any other
    strides; the plan passes the ones it already read); ``meta`` from the plan or built for
    a one-call."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(meta.lse_shape, dtype=torch.float32) if return_lse else None
    if qs is None:
        qs, ks, vs = q.stride(), k.stride(), v.stride()
    if meta.prefix == 0:
        kp = vp = pk0 = pk1 = pk2 = pv0 = pv1 = pv2 = rows = 0
        page_size = 1
    else:
        if pks is None:
            pks, pvs = prefix_k.stride(), prefix_v.stride()
        kp, vp = prefix_k.data_ptr(), prefix_v.data_ptr()
        shape = prefix_k.shape
        rows = shape[0]
        if meta.prefix == 2:  # pages [P, S, Hkv, D]: strides page, row, head
            pk0, pk1, pk2, _ = pks
            pv0, pv1, pv2, _ = pvs
            page_size = shape[1]
        else:  # rows [T, Hkv, D]
            pk1, pk2, _ = pks
            pv1, pv2, _ = pvs
            pk0 = pv0 = 0
            page_size = 1
    m, mp = meta.mask_part, meta.meta_part
    dt, batch, n, hq, hkv, head_dim, scale = meta.head
    os0, os1, os2 = meta.out_strides
    meta.ext.cascade_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        m[0],
        kp,
        vp,
        mp[0],
        mp[1],
        mp[2],
        dt,
        batch,
        n,
        hq,
        hkv,
        head_dim,
        scale,
        qs[0],
        qs[1],
        qs[2],
        ks[0],
        ks[1],
        ks[2],
        vs[0],
        vs[1],
        vs[2],
        os0,
        os1,
        os2,
        m[1],
        m[2],
        pk0,
        pk1,
        pk2,
        pv0,
        pv1,
        pv2,
        mp[3],
        rows,
        page_size,
        mp[4],
        mp[5],
        cpu.layer_threads(),
        CPP_ISA,
    )
    return (out, lse) if return_lse else out


class CascadeAttentionPlan:
    """``cascade_attention`` for many calls with the same shapes, mask and prefix layout
    (one model forward: one call per layer).

    The constructor validates everything once and prepares what does not change between
    layers (the packed mask, the page table / lengths or indptr as contiguous tensors, the
    backend); :meth:`run` only checks shapes and dtypes and calls the kernel.  On CPU
    tensors the ``cpp`` backend gets every address and stride directly, so ``prefix_k`` /
    ``prefix_v`` may be any views with a unit stride along D (e.g. a layer of a KV cache
    ``k[layer]`` [B, capacity, Hkv, D] as pages of ``page_size = capacity`` with the page
    table ``[[0], [1], ...]``): nothing is copied.

    Parameters
    ----------
    batch, n, hq, hkv, head_dim : the shapes of q [B, N, Hq, D] and k / v [B, N, Hkv, D];
        with ``suffix_indptr``, ``batch`` = B requests and ``n`` = T rows of the ragged q
        [T, Hq, D] and k / v [T, Hkv, D].
    dtype, device : of q, k, v and the prefix.
    mask : as for :func:`cascade_attention` (packed int32 words or a dense bool mask; None:
        every suffix key visible).
    prefix_page_table, prefix_lens, max_prefix_len : a paged prefix (see
        :func:`cascade_attention`), or prefix_indptr : a ragged one; neither: no prefix.
    sm_scale : default ``1 / sqrt(head_dim)``.
    backend : as for :func:`cascade_attention`, resolved once here.
    suffix_indptr : optional int32 / int64 [B + 1] ending at T = ``n``: ragged suffixes as for
        :func:`cascade_attention` (``mask`` then packed words [T, ceil(max_n / 32)]).  Read
        once here; the padding indices and padded mask are prepared once, and each run pads,
        calls the batched kernel and gathers the real rows back.

    Example
    -------
    >>> import torch, dspec
    >>> cache_k = cache_v = torch.randn(2, 1, 16, 2, 64)           # [layers, B, capacity, Hkv, D]
    >>> plan = dspec.ops.CascadeAttentionPlan(1, 4, 4, 2, 64, torch.float32, "cpu",
    ...     dspec.masks.causal(4).words if hasattr(dspec, "masks") else None,
    ...     prefix_page_table=torch.zeros(1, 1, dtype=torch.int32),
    ...     prefix_lens=torch.tensor([10], dtype=torch.int32))
    >>> q = torch.randn(1, 4, 4, 64); k = v = torch.randn(1, 4, 2, 64)
    >>> plan.run(q, k, v, cache_k[0], cache_v[0]).shape
    torch.Size([1, 4, 4, 64])

    Ragged: two requests with 1 and 3 suffix rows (T = 4), no prefix.

    >>> plan = dspec.ops.CascadeAttentionPlan(2, 4, 4, 2, 64, torch.float32, "cpu",
    ...     suffix_indptr=torch.tensor([0, 1, 4], dtype=torch.int32))
    >>> plan.run(torch.randn(4, 4, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64)).shape
    torch.Size([4, 4, 64])
    """

    def __init__(
        self,
        batch: int,
        n: int,
        hq: int,
        hkv: int,
        head_dim: int,
        dtype: torch.dtype,
        device="cpu",
        mask=None,
        *,
        prefix_page_table=None,
        prefix_lens=None,
        max_prefix_len: int | None = None,
        prefix_indptr=None,
        sm_scale=None,
        backend: str | None = None,
        suffix_indptr=None,
    ):
        for name, value, low in (
            ("batch", batch, 0),
            ("n", n, 0),
            ("hq", hq, 1),
            ("hkv", hkv, 1),
            ("head_dim", head_dim, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if hq % hkv:
            raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({hkv})")
        if dtype not in _REFERENCE_DTYPES:
            raise ValueError(f"dtype must be one of {_REFERENCE_DTYPES}, got {dtype}")
        device = _validate.device("device", device)
        self.batch, self.n, self.hq, self.hkv, self.head_dim = batch, n, hq, hkv, head_dim
        self.dtype, self.device = dtype, device
        self._layout = None
        if suffix_indptr is not None:
            self._init_ragged(
                mask, suffix_indptr, prefix_page_table, prefix_lens, max_prefix_len, prefix_indptr, sm_scale, backend
            )
            return
        self.mask = _check_mask(mask, batch, n, device)
        self.paged = prefix_page_table is not None or prefix_lens is not None
        if self.paged:
            if prefix_indptr is not None:
                raise ValueError("give either prefix_indptr (ragged) or prefix_page_table + prefix_lens (paged)")
            if prefix_page_table is None or prefix_lens is None:
                raise ValueError("a paged prefix needs prefix_page_table and prefix_lens")
            _validate.tensor("prefix_page_table", prefix_page_table, dim=2, dtypes=(torch.int32,))
            _validate.tensor("prefix_lens", prefix_lens, dim=1, dtypes=(torch.int32,))
            if prefix_page_table.shape[0] != batch or prefix_lens.shape[0] != batch:
                raise ValueError(
                    f"prefix_page_table [B, max_pages] and prefix_lens [B] need B = {batch}, "
                    f"got {list(prefix_page_table.shape)} and {list(prefix_lens.shape)}"
                )
            _validate.same_device(device, "the plan", prefix_page_table=prefix_page_table, prefix_lens=prefix_lens)
            prefix_page_table, prefix_lens = prefix_page_table.contiguous(), prefix_lens.contiguous()
            if batch and _validate.value_checks_enabled(prefix_lens) and bool((prefix_lens < 0).any()):
                raise ValueError(f"prefix_lens must be >= 0, got {prefix_lens.tolist()[:16]}")
        elif prefix_indptr is not None:
            _validate.tensor("prefix_indptr", prefix_indptr, dim=1, dtypes=_validate.ID_DTYPES)
            if prefix_indptr.shape[0] != batch + 1:
                raise ValueError(f"prefix_indptr must have B + 1 = {batch + 1} entries, got {prefix_indptr.shape[0]}")
            _validate.same_device(device, "the plan", prefix_indptr=prefix_indptr)
            prefix_indptr = prefix_indptr.contiguous()
            if _validate.value_checks_enabled(prefix_indptr):
                ip = prefix_indptr.long()
                if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()):
                    raise ValueError(f"prefix_indptr must start at 0 and never decrease; got {ip.tolist()[:16]}")
        self.has_prefix = self.paged or prefix_indptr is not None
        self.prefix_indptr, self.prefix_page_table, self.prefix_lens = prefix_indptr, prefix_page_table, prefix_lens
        _check_max_prefix_len(max_prefix_len)
        self.max_prefix_len = max_prefix_len
        self.sm_scale = _sm_scale(sm_scale)
        self._requested = backend
        self.backend = backend_for_rows(resolve_backend(backend, device, dtype, False), backend, n)
        self._q_shape = (batch, n, hq, head_dim)
        self._kv_shape = (batch, n, hkv, head_dim)
        self._prefix_tail = (hkv, head_dim)
        self._prefix_dim = 4 if self.paged else 3
        self._checked_rows = None  # prefix rows / pages whose metadata values were checked
        self._meta = None
        self._sdpa = None
        if self.backend == "sdpa":
            self._sdpa = _SdpaLayout(self.mask, batch, n, prefix_indptr, prefix_page_table, prefix_lens, device)
        if self.backend == "cpp":
            self._meta = _CppMeta(
                batch,
                n,
                hq,
                hkv,
                head_dim,
                dtype,
                self.mask,
                prefix_indptr,
                prefix_page_table,
                prefix_lens,
                self.sm_scale,
                self.has_prefix,
            )

    def _init_ragged(
        self, mask, suffix_indptr, prefix_page_table, prefix_lens, max_prefix_len, prefix_indptr, sm_scale, backend
    ):
        """The ragged form: a batched plan over the padded [B, max_n] suffixes."""
        _validate.tensor("suffix_indptr", suffix_indptr, dim=1, dtypes=_validate.ID_DTYPES)
        if suffix_indptr.shape[0] != self.batch + 1:
            raise ValueError(f"suffix_indptr must have B + 1 = {self.batch + 1} entries, got {suffix_indptr.shape[0]}")
        _check_suffix_indptr(suffix_indptr, self.n, self.device)
        layout = _RaggedLayout(suffix_indptr, self.device)
        mask = _check_ragged_mask(mask, layout, self.device)
        self._layout = layout
        self._inner = CascadeAttentionPlan(
            self.batch,
            layout.max_n,
            self.hq,
            self.hkv,
            self.head_dim,
            self.dtype,
            self.device,
            layout.mask(mask),
            prefix_page_table=prefix_page_table,
            prefix_lens=prefix_lens,
            max_prefix_len=max_prefix_len,
            prefix_indptr=prefix_indptr,
            sm_scale=sm_scale,
            backend=backend,
        )
        inner = self._inner
        self.mask, self.paged, self.has_prefix, self.backend = inner.mask, inner.paged, inner.has_prefix, inner.backend
        self.sm_scale, self.max_prefix_len = inner.sm_scale, inner.max_prefix_len
        self.prefix_indptr, self.prefix_page_table, self.prefix_lens = (
            inner.prefix_indptr,
            inner.prefix_page_table,
            inner.prefix_lens,
        )

    def _run_ragged(self, q, k, v, prefix_k, prefix_v, return_lse):
        layout = self._layout
        for name, t in (("q", q), ("k", k), ("v", v)):
            _validate.tensor(name, t, dim=3, dtypes=(self.dtype,))
        q_shape, kv_shape = (self.n, self.hq, self.head_dim), (self.n, self.hkv, self.head_dim)
        if q.shape != q_shape or k.shape != kv_shape or v.shape != kv_shape:
            raise ValueError(
                f"the plan takes q {list(q_shape)} and k, v {list(kv_shape)}, got "
                f"{list(q.shape)}, {list(k.shape)} and {list(v.shape)}"
            )
        _validate.same_device(self.device, "the plan", q=q, k=k, v=v)
        result = self._inner.run(layout.pad(q), layout.pad(k), layout.pad(v), prefix_k, prefix_v, return_lse=return_lse)
        if return_lse:
            return layout.gather(result[0]), layout.gather(result[1])
        return layout.gather(result)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_k=None,
        prefix_v=None,
        *,
        return_lse: bool = False,
    ):
        """Attention of this plan's queries: q [B, N, Hq, D], k / v [B, N, Hkv, D] (ragged
        plan: q [T, Hq, D], k / v [T, Hkv, D]) and, when the plan has a prefix, this layer's
        prefix_k / prefix_v (ragged [T, Hkv, D] or paged [pages, page_size, Hkv, D], unit
        stride along D).  Returns out [B, N, Hq, D] (ragged: [T, Hq, D]) in q's dtype (and
        lse [B, N, Hq] / [T, Hq] float32 with ``return_lse``)."""
        if self._layout is not None:
            return self._run_ragged(q, k, v, prefix_k, prefix_v, return_lse)
        if self._sdpa is not None and not return_lse and self._plain_call(q, k, v, prefix_k, prefix_v):
            return self._sdpa.run(q, k, v, prefix_k, prefix_v, self.sm_scale)
        meta = self._meta
        # the C++ code directly: plain CPU tensors, nothing traced, no autograd; every
        # other case (and every error message) goes through _run_general
        if (
            meta is None
            or type(q) is not _Tensor
            or type(k) is not _Tensor
            or type(v) is not _Tensor
            or not (q.is_cpu and k.is_cpu and v.is_cpu)
            or _get_current_dispatch_mode() is not None
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        ):
            return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
        dtype = self.dtype
        if (
            q.shape != self._q_shape
            or k.shape != self._kv_shape
            or v.shape != self._kv_shape
            or q.dtype != dtype
            or k.dtype != dtype
            or v.dtype != dtype
        ):
            return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
            return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
        pks = pvs = None
        if meta.prefix:
            if (
                type(prefix_k) is not _Tensor
                or type(prefix_v) is not _Tensor
                or not (prefix_k.is_cpu and prefix_v.is_cpu)
                or prefix_k.dtype != dtype
                or prefix_v.dtype != dtype
                or (torch.is_grad_enabled() and (prefix_k.requires_grad or prefix_v.requires_grad))
            ):
                return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
            shape = prefix_k.shape
            pks, pvs = prefix_k.stride(), prefix_v.stride()
            if (
                len(shape) != self._prefix_dim
                or shape != prefix_v.shape
                or shape[-1] != self.head_dim
                or shape[-2] != self.hkv
                or pks[-1] != 1
                or pvs[-1] != 1
            ):
                return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
        elif prefix_k is not None or prefix_v is not None:
            return self._run_general(q, k, v, prefix_k, prefix_v, return_lse)
        return _cpp_run(meta, q, k, v, prefix_k, prefix_v, return_lse, qs, ks, vs, pks, pvs)

    def _plain_call(self, q, k, v, prefix_k, prefix_v) -> bool:
        """An eager call on plain CPU tensors of the plan's shapes and dtype with a unit
        stride along D, nothing traced and no autograd: the "sdpa" route may run directly."""
        tensors = (q, k, v) if not self.has_prefix else (q, k, v, prefix_k, prefix_v)
        if not _eager_cpu(tensors) or any(t.dtype != self.dtype or t.stride(-1) != 1 for t in tensors):
            return False
        if q.shape != self._q_shape or k.shape != self._kv_shape or v.shape != self._kv_shape:
            return False
        if not self.has_prefix:
            return prefix_k is None and prefix_v is None
        shape = prefix_k.shape
        return (
            len(shape) == self._prefix_dim
            and shape == prefix_v.shape
            and shape[-2:] == self._prefix_tail
            and shape[0] == self._checked_rows
        )

    def _run_general(self, q, k, v, prefix_k, prefix_v, return_lse):
        """Every other case: all checks (with their error messages), the prefix metadata
        values checked once per prefix size, then the one-call path (the custom op when
        tracing; the torch reference when autograd must record the call)."""
        dtype = self.dtype
        for name, t in (("q", q), ("k", k), ("v", v)):
            _validate.tensor(name, t, dim=4, dtypes=(dtype,))
        if q.shape != self._q_shape or k.shape != self._kv_shape or v.shape != self._kv_shape:
            raise ValueError(
                f"the plan takes q {list(self._q_shape)} and k, v {list(self._kv_shape)}, got "
                f"{list(q.shape)}, {list(k.shape)} and {list(v.shape)}"
            )
        if self.has_prefix:
            if prefix_k is None or prefix_v is None:
                raise ValueError("the plan has a prefix: give this layer's prefix_k and prefix_v")
            _validate.tensor("prefix_k", prefix_k, dim=self._prefix_dim, dtypes=(dtype,))
            _validate.tensor("prefix_v", prefix_v, dim=self._prefix_dim, dtypes=(dtype,))
            if prefix_k.shape != prefix_v.shape or prefix_k.shape[-2:] != self._prefix_tail:
                lay = "[pages, page_size, Hkv, D]" if self.paged else "[T, Hkv, D]"
                raise ValueError(
                    f"prefix_k and prefix_v must have shape {lay} with Hkv, D = "
                    f"{self._prefix_tail}, got {list(prefix_k.shape)} and {list(prefix_v.shape)}"
                )
            if prefix_k.stride(-1) != 1 or prefix_v.stride(-1) != 1:
                raise ValueError("prefix_k / prefix_v must be contiguous along D")
        elif prefix_k is not None or prefix_v is not None:
            raise ValueError("the plan has no prefix: prefix_k and prefix_v must be None")
        _validate.same_device(self.device, "the plan", q=q, k=k, v=v, prefix_k=prefix_k, prefix_v=prefix_v)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        name = self.backend
        if name == "cpp" and _needs_grad(q, k, v, prefix_k, prefix_v):
            name = resolve_backend(self._requested, self.device, dtype, True)
        if self.has_prefix and prefix_k.shape[0] != self._checked_rows:
            if self.paged:
                _check_paged_prefix(
                    prefix_k,
                    prefix_v,
                    None,
                    self.prefix_page_table,
                    self.prefix_lens,
                    self.batch,
                    self.hkv,
                    self.head_dim,
                    dtype,
                    self.device,
                )
            else:
                _check_ragged_prefix(
                    prefix_k, prefix_v, self.prefix_indptr, self.batch, self.hkv, self.head_dim, dtype, self.device
                )
            self._checked_rows = prefix_k.shape[0]
        return _launch(
            q,
            k,
            v,
            self.mask,
            prefix_k,
            prefix_v,
            self.prefix_indptr,
            self.prefix_page_table,
            self.prefix_lens,
            self.sm_scale,
            bool(return_lse),
            self.max_prefix_len,
            name,
        )


def _increasing_from_zero(indptr: torch.Tensor, end: int) -> bool:
    """Whether ``indptr`` starts at 0, never decreases and ends at most at ``end``: a list
    walk for a short one (a few microseconds where torch's reductions take tens)."""
    if indptr.numel() <= 256:
        ip = indptr.tolist()
        return ip[0] == 0 and ip[-1] <= end and all(a <= b for a, b in zip(ip, ip[1:]))
    ip = indptr.long()
    return int(ip[0]) == 0 and not bool((ip[1:] < ip[:-1]).any()) and int(ip[-1]) <= end


def _check_ragged_prefix(prefix_k, prefix_v, prefix_indptr, batch, hkv, head_dim, dtype, device):
    if (prefix_k is None) != (prefix_v is None) or (prefix_k is None) != (prefix_indptr is None):
        raise ValueError("prefix_k, prefix_v and prefix_indptr must be given together")
    if prefix_k is None:
        return None, None
    _validate.tensor("prefix_k", prefix_k, dim=3, dtypes=(dtype,))
    _validate.tensor("prefix_v", prefix_v, dim=3, dtypes=(dtype,))
    _validate.tensor("prefix_indptr", prefix_indptr, dim=1, dtypes=_validate.ID_DTYPES)
    if prefix_k.shape != prefix_v.shape or prefix_k.shape[1:] != (hkv, head_dim):
        raise ValueError(
            f"prefix_k and prefix_v must have shape [T, Hkv, D] = [T, {hkv}, {head_dim}], "
            f"got {list(prefix_k.shape)} and {list(prefix_v.shape)}"
        )
    if prefix_indptr.shape[0] != batch + 1:
        raise ValueError(f"prefix_indptr must have B + 1 = {batch + 1} entries, got {prefix_indptr.shape[0]}")
    _validate.same_device(device, "q", prefix_k=prefix_k, prefix_v=prefix_v, prefix_indptr=prefix_indptr)
    if _validate.value_checks_enabled(prefix_indptr):
        if _increasing_from_zero(prefix_indptr, prefix_k.shape[0]) is False:
            raise ValueError(
                f"prefix_indptr must start at 0, never decrease and end at most at "
                f"T = {prefix_k.shape[0]}; got {prefix_indptr.tolist()[:16]}"
            )
    if prefix_k.stride(-1) != 1 or prefix_v.stride(-1) != 1:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    return prefix_k, prefix_v


def _check_paged_prefix(prefix_k, prefix_v, prefix_indptr, table, lens, batch, hkv, head_dim, dtype, device):
    if prefix_indptr is not None:
        raise ValueError("give either prefix_indptr (ragged) or prefix_page_table + prefix_lens (paged)")
    if prefix_k is None or prefix_v is None or table is None or lens is None:
        raise ValueError("a paged prefix needs prefix_k, prefix_v, prefix_page_table and prefix_lens")
    _validate.tensor("prefix_k", prefix_k, dim=4, dtypes=(dtype,))
    _validate.tensor("prefix_v", prefix_v, dim=4, dtypes=(dtype,))
    _validate.tensor("prefix_page_table", table, dim=2, dtypes=(torch.int32,))
    _validate.tensor("prefix_lens", lens, dim=1, dtypes=(torch.int32,))
    if prefix_k.shape != prefix_v.shape or prefix_k.shape[2:] != (hkv, head_dim):
        raise ValueError(
            f"paged prefix_k and prefix_v must have shape [pages, page_size, Hkv, D] = "
            f"[P, S, {hkv}, {head_dim}], got {list(prefix_k.shape)} and {list(prefix_v.shape)}"
        )
    if prefix_k.stride(-1) != 1 or prefix_v.stride(-1) != 1:
        raise ValueError("paged prefix_k / prefix_v must be contiguous along D")
    if table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(
            f"prefix_page_table [B, max_pages] and prefix_lens [B] need B = {batch}, "
            f"got {list(table.shape)} and {list(lens.shape)}"
        )
    _validate.same_device(device, "q", prefix_k=prefix_k, prefix_v=prefix_v, prefix_page_table=table, prefix_lens=lens)
    if batch and _validate.value_checks_enabled(lens):
        page_size, pages = prefix_k.shape[1], prefix_k.shape[0]
        if bool((lens < 0).any()) or int(lens.max()) > table.shape[1] * page_size:
            raise ValueError(
                f"prefix_lens must lie in [0, max_pages * page_size] = "
                f"[0, {table.shape[1] * page_size}], got {lens.tolist()[:16]}"
            )
        used = torch.arange(table.shape[1], device=device)[None, :] * page_size < lens[:, None]
        bad = used & ((table < 0) | (table >= pages))
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(f"prefix_page_table[{b}, {i}] = {int(table[b, i])} is not a page in [0, {pages})")


def merge_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor | None = None,
    lse_b: torch.Tensor | None = None,
    *,
    backend: str | None = None,
):
    """Combine partial attention results over disjoint key sets: two (pairwise form) or S
    at once (two-argument form).

    Parameters
    ----------
    o_a, o_b : [..., D] float32/float16/bfloat16, each normalised over its own keys.
    lse_a, lse_b : [...] float32, natural-log logsumexp of each part's scaled scores.

    Two-argument form ``merge_states(v, lse)``: v [..., S, H, D] float32/float16/bfloat16
    and lse [..., S, H] float32 hold S states (S >= 1) of the same H heads; they merge
    along S.  It runs torch ops on every backend (``backend`` is still checked).

    Returns
    -------
    (o [..., D] in o_a's dtype, lse [...] float32): ``o = (e^{lse_a} o_a + e^{lse_b} o_b) /
    (e^{lse_a} + e^{lse_b})``; two empty states (lse = -inf) give o = 0, lse = -inf.
    Two-argument form: (o [..., H, D] in v's dtype, lse [..., H] float32), ``o = sum_s
    e^{lse_s} v_s / sum_s e^{lse_s}``, ``lse = log sum_s e^{lse_s}``; -inf entries are
    states with no keys (weight 0), all -inf gives o = 0, lse = -inf; S = 1 returns the one
    state as given.

    Example
    -------
    >>> import torch, dspec
    >>> o, lse = dspec.merge_states(torch.ones(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(2))
    >>> o[0].tolist(), round(lse[0].item(), 4)
    ([0.5, 0.5, 0.5, 0.5], 0.6931)
    >>> v = torch.stack([torch.ones(1, 4), torch.zeros(1, 4), 2 * torch.ones(1, 4)])  # [S, H, D]
    >>> o, lse = dspec.merge_states(v, torch.zeros(3, 1))     # S = 3 states, H = 1, D = 4
    >>> o.shape, o[0].tolist(), round(lse[0].item(), 4)
    (torch.Size([1, 4]), [1.0, 1.0, 1.0, 1.0], 1.0986)
    """
    if o_b is None and lse_b is None:
        return _merge_many(o_a, lse_a, backend)
    if o_b is None or lse_b is None:
        raise ValueError("merge_states takes (v, lse) or (o_a, lse_a, o_b, lse_b): give o_b and lse_b together")
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


def _merge_many(v, lse, backend):
    """The S-state form of merge_states: v [..., S, H, D], lse [..., S, H]."""
    _validate.tensor("v", v, min_dim=3, dtypes=_ATTN_DTYPES)
    _validate.tensor("lse", lse, dtypes=(torch.float32,))
    if lse.shape != v.shape[:-1]:
        raise ValueError(
            f"lse must have shape v.shape[:-1] = [..., S, H] = {list(v.shape[:-1])}, got {list(lse.shape)}"
        )
    if v.shape[-3] == 0:
        raise ValueError(f"v must hold S >= 1 states along dim -3 (shape [..., S, H, D]), got {list(v.shape)}")
    _validate.same_device(v.device, "v", lse=lse)
    _library.resolve("merge_states", backend, v.device, ("torch", "triton", "cuda", "cpp"))
    if v.shape[-3] == 1:
        return v.select(-3, 0), lse.select(-2, 0)
    return _reference.merge_states_many(v, lse)


@_library.body('merge_states')
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
            oa.data_ptr(),
            la.data_ptr(),
            ob.data_ptr(),
            lb.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            _backend.FLOAT_CODE[oa.dtype],
            rows,
            head_dim,
            "cuda" if cuda else "cpu",
            stream,
            cpu.layer_threads(),
        )
    return out.reshape(o_a.shape), lse.reshape(lse_a.shape)

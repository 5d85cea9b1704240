"""Per-request prefix KV cache, ragged across the batch, exact.

Storage is one padded buffer per K and V, ``[layers, B, capacity, Hkv, D]``, with the
committed length of every request, kept both on the cache's device (``device_lengths``)
and on the host (``lengths``).  Row t < lengths[b] of request
b holds the key/value (keys after RoPE) of its t-th committed token; rows past the length
are garbage and never read.  ``prefix(layer)`` hands a layer's prefix to
``dspec.cascade_attention`` in either layout it takes:

- ``"ragged"``: ``prefix_k/prefix_v [T, Hkv, D]`` back to back + ``prefix_indptr [B + 1]``
  (one gather of the committed rows per layer; a view when B = 1);
- ``"paged"``: the buffer itself as ``[pages = B, page_size = capacity, Hkv, D]`` with the
  page table ``[[0], [1], ...]`` and the lengths: zero-copy, what GPUs use.

``"auto"`` picks ragged on CPU (the torch reference gathers pages anyway) and paged on CUDA.

Commit (``append``) copies a chosen subset of a forward's suffix rows, per request and in
the given order, behind the request's committed rows: the accepted path of a tree, the
accepted prefix of a chain, a whole block.  ``rollback`` / ``crop`` only move lengths.
Nothing is recomputed or approximated: a committed row is bit-for-bit the suffix row.

Host synchronisation: ``append`` with ``keep`` / ``counts`` given as tensors on the
cache's device while ``dspec.config.validate_values`` is off (as a speculative step passes
``verify_*`` results) runs entirely on the device: the host only learns an upper bound of
the lengths, which is all the paged ``prefix()`` needs (``max_prefix_len``).  The exact
host lengths are fetched (one device-to-host copy) only when something asks for them:
``lengths``, ``max_length``, ``rollback``, ``crop``, the ragged layout, or an ``append``
that may outgrow the capacity (amortised by doubling).  Lists / ints / CPU tensors take the
validated host path.  Rows past a request's length may hold garbage from such an append.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import _backend, _validate, cpu
from .dense import untracked

_LAYOUTS = ("auto", "ragged", "paged")


class SuffixKV:
    """The keys (after RoPE) and values a forward computed for its suffix tokens.

    keys[l], values[l]: [B, N, Hkv, D], one pair per layer.  ``stacked`` (optional): the
    same as one tensor [2, L, B, N, Hkv, D] (keys = stacked[0]), as the one-call layer stack
    writes them; the cache then commits every layer without restacking, and the per-layer
    lists are views made on first use.
    """

    __slots__ = ("_keys", "_values", "stacked")

    def __init__(
        self,
        keys: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
        *,
        stacked: torch.Tensor | None = None,
    ):
        if stacked is None and (keys is None or values is None):
            raise ValueError("SuffixKV needs keys and values, or stacked")
        if stacked is not None and (stacked.dim() != 6 or stacked.shape[0] != 2):
            raise ValueError(f"stacked must be [2, L, B, N, Hkv, D], got {list(stacked.shape)}")
        self._keys, self._values, self.stacked = keys, values, stacked

    @property
    def keys(self) -> list[torch.Tensor]:
        if self._keys is None:
            self._keys = list(self.stacked[0].unbind(0))
        return self._keys

    @property
    def values(self) -> list[torch.Tensor]:
        if self._values is None:
            self._values = list(self.stacked[1].unbind(0))
        return self._values

    @property
    def num_layers(self) -> int:
        return self.stacked.shape[1] if self.stacked is not None else len(self._keys)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, N, Hkv, D)."""
        if self.stacked is not None:
            return tuple(self.stacked.shape[2:])
        return tuple(self._keys[0].shape)

    def __repr__(self) -> str:
        return f"SuffixKV(layers={self.num_layers}, shape={list(self.shape) if self.num_layers else None})"


class KVCache:
    """Prefix KV cache for a batch of requests with ragged lengths.

    Parameters
    ----------
    num_layers, batch_size, num_kv_heads, head_dim : the model's shape and the batch.
    dtype, device : those of the model's keys/values.
    capacity : rows reserved per request up front (grows by doubling when exceeded).
    layout : "auto" | "ragged" | "paged", how ``prefix()`` hands rows to cascade_attention.

    Use ``Model.new_cache(batch_size)`` to get one shaped for a model.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype=torch.float32,
        device="cpu",
        capacity: int = 0,
        layout: str = "auto",
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        cap = _round_capacity(capacity) if capacity else 0
        self.k = torch.empty(num_layers, batch_size, cap, num_kv_heads, head_dim, dtype=dtype, device=self.device)
        self.v = torch.empty_like(self.k)
        self._views = {}
        self._lengths = torch.zeros(batch_size, dtype=torch.int64)

    # Lengths live in two copies: ``_device_lengths`` (always exact, on the cache's device)
    # and ``_host_lengths`` (a CPU tensor, or None while a device-side append left it stale).
    # ``_bound`` (a Python int) is >= every length and <= capacity at all times.

    @property
    def _lengths(self) -> torch.Tensor:
        """The exact lengths on the host (one device-to-host copy when stale)."""
        if self._host_lengths is None:
            self._host_lengths = self._device_lengths.to("cpu")
            self._bound = max(self._host_lengths.tolist(), default=0)
        return self._host_lengths

    @_lengths.setter
    def _lengths(self, value: torch.Tensor) -> None:
        self._host_lengths = value
        self._device_lengths = value.to(self.device)
        self._bound = max(value.tolist(), default=0)  # host data: no device read

    # ---------------------------------------------------------------------------- state

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per request, int64 [B] on the CPU (a copy; after a device-side
        ``append`` this reads the device, see the module docstring)."""
        return self._lengths.clone()

    @property
    def device_lengths(self) -> torch.Tensor:
        """Committed tokens per request, int64 [B] on the cache's device; never syncs."""
        return self._device_lengths

    @property
    def length_bound(self) -> int:
        """An upper bound of every request's length known on the host (exact unless a
        device-side ``append`` ran since the host last read the lengths)."""
        return self._bound

    @property
    def max_length(self) -> int:
        return max(self._lengths.tolist(), default=0)

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, lengths="
            f"{self._lengths.tolist()}, capacity={self.capacity}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, layout={self.resolved_layout})"
        )

    @property
    def resolved_layout(self) -> str:
        if self.layout != "auto":
            return self.layout
        return "paged" if self.device.type == "cuda" else "ragged"

    def _changed(self) -> None:
        self._views = {}

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` rows per request (never shrinks)."""
        if capacity <= self.capacity:
            return
        cap = max(_round_capacity(capacity), 2 * self.capacity)
        shape = (self.num_layers, self.batch_size, cap, self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        used = min(self._bound, self.capacity)  # every committed row lies below
        if used:
            rows = torch.arange(used, device=self.device)
            groups = self.num_layers * self.batch_size
            for old, grown in ((self.k, k), (self.v, v)):
                move_rows(old.view(groups, self.capacity, -1), grown.view(groups, cap, -1), rows, rows)
        self.k, self.v = k, v
        self._changed()

    # --------------------------------------------------------------------------- commit

    def append(self, suffix_kv: SuffixKV, keep=None, *, counts=None) -> torch.Tensor:
        """Commit suffix rows behind each request's prefix; returns the rows added per request.

        suffix_kv : the ``suffix_kv`` of a forward whose plan used this cache (its N tokens
            sat at positions lengths[b] + ... when computed; committing keeps those keys).
        keep : which suffix positions to commit, per request, in order:
            - None: all N (with ``counts``: the first counts[b]);
            - int tensor [B, K] (or [K] for every request) of suffix indices, -1 = unused
              slot (e.g. ``[0] + verify_tree(...).path`` for the root and accepted path);
            - bool tensor [B, N] (or [N]): the True positions, in increasing order;
            - a list of B sequences of indices (ragged).
        counts : int [B] (or an int): commit the first counts[b] suffix positions of request b
            (the accepted prefix of a chain, the valid part of a right-padded row).

        Returns the rows added per request, int64 [B]: on the CPU from the host path, on the
        cache's device from the device path (``keep`` / ``counts`` a tensor on the cache's
        device while value checks are off: no host synchronisation, see the module
        docstring).
        """
        if not isinstance(suffix_kv, SuffixKV):
            raise ValueError(
                f"suffix_kv must be a SuffixKV (a forward's output.suffix_kv), got {type(suffix_kv).__name__}"
            )
        stacked = suffix_kv.stacked
        if suffix_kv.num_layers != self.num_layers or (stacked is None and len(suffix_kv.values) != self.num_layers):
            raise ValueError(f"suffix_kv has {suffix_kv.num_layers} layers, the cache {self.num_layers}")
        batch, n, hkv, d = suffix_kv.shape
        if batch != self.batch_size or hkv != self.num_kv_heads or d != self.head_dim:
            raise ValueError(
                f"suffix_kv has shape [B, N, Hkv, D] = {[batch, n, hkv, d]}, the cache "
                f"expects B = {self.batch_size}, Hkv = {self.num_kv_heads}, D = {self.head_dim}"
            )
        for t in (suffix_kv.keys + suffix_kv.values) if stacked is None else [stacked[0, 0]]:
            if t.shape != (batch, n, hkv, d) or t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"suffix_kv holds a {t.dtype} {list(t.shape)} tensor on {t.device}; the "
                    f"cache expects {self.dtype} [{batch}, {n}, {hkv}, {d}] on {self.device}"
                )
        given = keep if isinstance(keep, torch.Tensor) else counts
        if (
            self.device.type != "cpu"
            and isinstance(given, torch.Tensor)
            and given.device == self.device
            and not _validate.value_checks_enabled(given)
        ):
            index = _device_keep_index(keep, counts, batch, n, self.device)  # [B, K], no reads
            return self._commit(suffix_kv, index, None)
        index = host_keep_index(keep, counts, batch, n)  # [B, K] int64, values checked
        used = (index >= 0).sum(1).astype(np.int64)
        added = torch.from_numpy(used)
        if not used.any():  # host data, no tensor read
            return added
        index = torch.from_numpy(np.array(index, dtype=np.int64, order="C")).to(self.device)
        self._commit(suffix_kv, index, self._lengths + added, added)
        return added

    def _commit(self, suffix_kv: SuffixKV, index: torch.Tensor, host_lengths, added=None) -> torch.Tensor:
        """Copy suffix rows ``index`` [B, K] (used slots first, -1 after) behind each
        request's rows, on the device.  Slot j of request b goes to row ``length[b] + j``,
        so unused slots write (garbage) rows past the new length, never read (the CPU's
        one-call path skips them): no value-dependent shape, no host read.
        ``host_lengths``: the new lengths when the host knows them (None: the device path);
        ``added``: the used slots per request when already counted."""
        batch, n, hkv, d = suffix_kv.shape
        slots = index.shape[1]
        if added is None:
            added = (index >= 0).sum(1)
        if slots == 0:
            return added
        if self._bound + slots > self.capacity:
            # room for every slot past the longest request: the exact lengths tell (one host
            # read after device-side appends; doubling keeps it rare)
            self.reserve(self.max_length + slots)
        cap = self.capacity
        if not _commit_rows_cpu(suffix_kv, self.k, self.v, index, self._device_lengths, cap):
            self._commit_by_index(suffix_kv, index, cap)
        if host_lengths is not None:
            self._lengths = host_lengths
        else:
            self._device_lengths = self._device_lengths + added
            self._host_lengths = None
            self._bound = min(self._bound + slots, cap)
        self._changed()
        return added

    def _commit_by_index(self, suffix_kv: SuffixKV, index: torch.Tensor, cap: int) -> None:
        """:meth:`_commit`'s copy as index tensors and one gather + scatter per K / V."""
        batch, n, hkv, d = suffix_kv.shape
        slots = index.shape[1]
        dev = self.device
        rows = torch.arange(batch, device=dev)[:, None]
        dst = (rows * cap + self._device_lengths[:, None] + torch.arange(slots, device=dev)).reshape(-1)
        src = (rows * n + index.clamp(min=0)).reshape(-1)
        layers = self.num_layers
        stacked = suffix_kv.stacked
        for i, buf in enumerate((self.k, self.v)):
            # every layer in one gather and one scatter (not two ops per layer)
            new = stacked[i] if stacked is not None else torch.stack(suffix_kv.keys if i == 0 else suffix_kv.values)
            move_rows(new.reshape(layers, batch * n, hkv * d), buf.view(layers, batch * cap, hkv * d), src, dst)

    def rollback(self, b: int, n: int) -> None:
        """Drop the last ``n`` committed tokens of request ``b``."""
        b = self._request(b)
        lengths = self._lengths.clone()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > int(lengths[b]):
            raise ValueError(f"n must be an int in [0, {int(lengths[b])}] (request {b}'s length), got {n!r}")
        lengths[b] -= n
        self._lengths = lengths
        self._changed()

    def crop(self, lengths) -> None:
        """Cut every request to ``lengths`` (an int for all, or B ints), each <= its length."""
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            new = torch.minimum(self._lengths, torch.tensor(lengths))
            if lengths < 0:
                raise ValueError(f"lengths must be >= 0, got {lengths}")
        else:
            new = _int_vector("lengths", lengths, self.batch_size)
            if bool((new < 0).any()) or bool((new > self._lengths).any()):
                raise ValueError(
                    f"lengths must lie in [0, current length] per request; current "
                    f"{self._lengths.tolist()}, got {new.tolist()}"
                )
        self._lengths = new.clone()
        self._changed()

    def reset(self) -> None:
        """Forget every committed token (keeps the memory)."""
        self._lengths = torch.zeros(self.batch_size, dtype=torch.int64)
        self._changed()

    def select(self, indices) -> "KVCache":
        """A cache holding only the requests ``indices`` (in that order), e.g. the unfinished."""
        idx = _int_vector("indices", indices, None)
        if idx.numel() == 0 or bool((idx < 0).any()) or bool((idx >= self.batch_size).any()):
            raise ValueError(
                f"indices must be a non-empty list of requests in [0, {self.batch_size}), got {idx.tolist()}"
            )
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        # only the rows below the host's length bound hold committed tokens
        cap, used = self.capacity, min(self._bound, self.capacity)
        out.k = torch.empty((self.num_layers, idx.numel()) + self.k.shape[2:], dtype=self.dtype, device=self.device)
        out.v = torch.empty_like(out.k)
        if used:
            rows = torch.arange(used)
            src = (idx[:, None] * cap + rows).reshape(-1).to(self.device)
            dst = (torch.arange(idx.numel())[:, None] * cap + rows).reshape(-1).to(self.device)
            for old, kept in ((self.k, out.k), (self.v, out.v)):
                move_rows(
                    old.view(self.num_layers, -1, self.num_kv_heads * self.head_dim),
                    kept.view(self.num_layers, -1, self.num_kv_heads * self.head_dim),
                    src,
                    dst,
                )
        out._lengths = self._lengths[idx].clone()
        out._views = {}
        return out

    def clone(self) -> "KVCache":
        return self.select(list(range(self.batch_size)))

    # --------------------------------------------------------------------------- reading

    def get(self, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's committed keys and values of one layer, [length, Hkv, D] views."""
        b = self._request(b)
        n = int(self._lengths[b])
        return self.k[layer, b, :n], self.v[layer, b, :n]

    def prefix(self, layer: int) -> dict:
        """``cascade_attention`` keyword arguments for this layer's prefix ({} when empty).

        The paged layout reads no lengths on the host (``max_prefix_len`` is the host's
        upper bound); the ragged one needs the exact lengths (row gather)."""
        if self._bound == 0:
            return {}
        if self.resolved_layout == "paged":
            table, lens = self.page_table()
            k, v = self.layer_pages(layer)
            return dict(prefix_k=k, prefix_v=v, prefix_page_table=table, prefix_lens=lens, max_prefix_len=self._bound)
        if self.max_length == 0:
            return {}
        k, v = self.layer_rows(layer)
        return dict(prefix_k=k, prefix_v=v, prefix_indptr=self.ragged_indptr())

    # Plan-once access (Model.forward): metadata built once per forward, then per layer
    # only views or one gather.

    def page_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged view of the storage: page table [[0], [1], ...] int32 [B, 1] and the
        lengths int32 [B] on the device (no host read); pages are ``layer_pages(i)``."""
        return self._view("paged", self._paged_meta)

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values as pages [B, capacity, Hkv, D] (views)."""
        return self.k[layer], self.v[layer]

    def ragged_indptr(self) -> torch.Tensor:
        """indptr [B + 1] of the committed rows back to back (``layer_rows``)."""
        return self._view("ragged", self._ragged_meta)[1]

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s committed rows back to back [T, Hkv, D] (a view when B = 1, else
        one gather with the row index built once)."""
        index, _ = self._view("ragged", self._ragged_meta)
        if index is None:  # B = 1: a view
            n = int(self._lengths[0])
            return self.k[layer, 0, :n], self.v[layer, 0, :n]
        flat_k = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        return flat_k.index_select(0, index), flat_v.index_select(0, index)

    def _view(self, key, make):
        if key not in self._views:
            self._views[key] = make()
        return self._views[key]

    def _paged_meta(self):
        table = torch.arange(self.batch_size, dtype=torch.int32, device=self.device)[:, None].contiguous()
        return table, self._device_lengths.to(torch.int32)

    def _ragged_meta(self):
        indptr = torch.zeros(self.batch_size + 1, dtype=torch.int64)
        indptr[1:] = self._lengths.cumsum(0)
        if self.batch_size == 1:
            return None, indptr.to(self.device)
        rows = torch.cat(
            [
                torch.arange(b * self.capacity, b * self.capacity + length)  # host data
                for b, length in enumerate(self._lengths.tolist())
            ]
        )
        return rows.to(self.device), indptr.to(self.device)

    def _request(self, b) -> int:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"b must be a request index in [0, {self.batch_size}), got {b!r}")
        return b


def _commit_rows_cpu(
    suffix_kv: SuffixKV, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor, cap: int
) -> bool:
    """The commit as one ``dspec._C.commit_rows`` call (the index arithmetic and both
    copies; unused slots are skipped, not written past the length); False where it does not
    apply (another device, per-layer suffix tensors, autograd).  A speculative cycle commits
    twice (target cache, drafter context) right after a forward, where each of the ~15 small
    torch ops of the index path costs ~10 us cold."""
    ext = _backend.extension()
    stacked = suffix_kv.stacked
    if (
        ext is None
        or not hasattr(ext, "commit_rows")
        or stacked is None
        or not stacked.is_cpu
        or not k.is_cpu
        or stacked.dtype != k.dtype
        or not stacked.is_contiguous()
        or not k.is_contiguous()
        or not v.is_contiguous()
        or not untracked(stacked, k, v)
    ):
        return False
    layers, batch, n, hkv, d = stacked.shape[1:]
    index = index.to(torch.int64).contiguous()
    lengths = lengths.to(torch.int64).contiguous()
    item = stacked.element_size()
    row = hkv * d * item
    ext.commit_rows(
        stacked[0].data_ptr(),
        stacked[1].data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        layers,
        batch * n * row,
        batch * cap * row,
        batch,
        n,
        cap,
        index.data_ptr(),
        index.shape[1],
        lengths.data_ptr(),
        row,
        cpu.layer_threads(),
    )
    return True


def move_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``dst[g, dst_rows[i]] = src[g, src_rows[i]]`` for every group g: src [G, Rs, W],
    dst [G, Rd, W] (rows of W contiguous elements, any group stride), index tensors int64 [R]
    on their device, dst_rows distinct.  On the CPU ``dspec._C.copy_rows`` (torch's
    index_copy_ opens an OpenMP team for a commit of ~100 KB, and its worker then spins on
    the cores the decoder's thread pool needs); elsewhere index_select + index_copy_."""
    ext = _backend.extension()
    if (
        ext is not None
        and hasattr(ext, "copy_rows")
        and src.is_cpu
        and dst.is_cpu
        and src.dtype == dst.dtype
        and src.shape[2] == dst.shape[2]
        and src.stride(2) == 1
        and dst.stride(2) == 1
        and src.stride(1) == src.shape[2]
        and dst.stride(1) == dst.shape[2]
        and untracked(src, dst)
    ):
        s_idx = src_rows.to(torch.int64).contiguous()
        d_idx = dst_rows.to(torch.int64).contiguous()
        item = src.element_size()
        ext.copy_rows(
            src.data_ptr(),
            dst.data_ptr(),
            src.shape[0],
            src.stride(0) * item,
            dst.stride(0) * item,
            src.shape[1],
            dst.shape[1],
            s_idx.numel(),
            s_idx.data_ptr(),
            d_idx.data_ptr(),
            src.shape[2] * item,
            cpu.layer_threads(),
        )
        return
    dst.index_copy_(1, dst_rows, src.index_select(1, src_rows))


def _round_capacity(n: int) -> int:
    return max(16, (n + 15) // 16 * 16)


def _int_vector(name: str, values, size: int | None) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor or a list of ints, got {values.dtype} {list(values.shape)}"
            )
        out = values.detach().to("cpu", torch.int64)
    else:
        if (
            not isinstance(values, Sequence)
            or isinstance(values, (str, bytes))
            or any(isinstance(v, bool) or not isinstance(v, int) for v in values)
        ):
            raise ValueError(f"{name} must be a list of ints or a 1-D integer tensor, got {values!r}")
        out = torch.tensor(list(values), dtype=torch.int64)
    if size is not None and out.numel() != size:
        raise ValueError(f"{name} must have {size} entries (one per request), got {out.numel()}")
    return out


def _device_keep_index(keep, counts, batch: int, n: int, device) -> torch.Tensor:
    """``host_keep_index`` for tensors on the cache's device, without reading their values
    (value checks are off): shapes and dtypes are checked, the contents trusted."""
    if keep is not None and counts is not None:
        raise ValueError("give keep or counts, not both")
    ar = torch.arange(n, device=device)
    if counts is not None:
        if counts.dim() != 1 or counts.shape[0] != batch or counts.is_floating_point() or counts.dtype == torch.bool:
            raise ValueError(f"counts must be an int tensor [B] = [{batch}], got {counts.dtype} {list(counts.shape)}")
        return torch.where(ar[None, :] < counts[:, None], ar[None, :], -1)
    return _tensor_keep_index(keep, batch, n)


def _tensor_keep_index(keep: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """A keep tensor -- bool mask [N] / [B, N] or indices [K] / [B, K] -- as indices [B, K]
    int64 on its own device (-1 = none; a mask's kept positions in increasing order).
    Checks shapes and dtypes only: reads no values."""
    if keep.dtype == torch.bool:
        if keep.dim() == 1:
            keep = keep.expand(batch, -1)
        if keep.shape != (batch, n):
            raise ValueError(f"a bool keep mask must have shape [N] or [B, N] = [{batch}, {n}], got {list(keep.shape)}")
        # stable order: True positions first, in increasing index order
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        return torch.where(torch.gather(keep, 1, order), order, -1)
    if keep.is_floating_point():
        raise ValueError(f"keep must hold integer indices or bools, got {keep.dtype}")
    keep = keep.to(torch.int64)
    if keep.dim() == 1:
        keep = keep.expand(batch, -1)
    if keep.dim() != 2 or keep.shape[0] != batch:
        raise ValueError(f"keep indices must have shape [K] or [B, K] with B = {batch}, got {list(keep.shape)}")
    return keep


def host_keep_index(keep, counts, batch: int, n: int) -> np.ndarray:
    """``keep`` / ``counts`` as suffix indices [B, K] int64 in numpy, -1 = none, their values
    checked (host data): ``counts`` an int, ints or an int tensor [B] (the first counts[b]
    positions; K = the largest count); ``keep`` None (all N), a bool mask [N] / [B, N], an
    index tensor [K] / [B, K] or B sequences of indices.  In numpy because a decode step
    appends right after a forward has streamed the weights, where each small torch op costs
    ~10-60 us cold; these checks cost a few us."""
    if counts is not None:
        if keep is not None:
            raise ValueError("give keep or counts, not both")
        if isinstance(counts, int) and not isinstance(counts, bool):
            c = np.full(batch, counts, dtype=np.int64)
        elif isinstance(counts, (list, tuple)) and all(type(x) is int for x in counts):
            c = np.asarray(counts, dtype=np.int64).reshape(-1)
        else:
            c = _int_vector("counts", counts, None).numpy()
        if c.shape[0] != batch:
            raise ValueError(f"counts must have {batch} entries (one per request), got {c.shape[0]}")
        if c.size and (c.min() < 0 or c.max() > n):
            raise ValueError(f"counts must lie in [0, N = {n}], got {c.tolist()}")
        ar = np.arange(n, dtype=np.int64)
        width = int(c.max()) if c.size else 0
        return np.where(ar[None, :width] < c[:, None], ar[None, :width], -1)
    if keep is None:
        return np.broadcast_to(np.arange(n, dtype=np.int64), (batch, n))
    if isinstance(keep, torch.Tensor):
        index = _tensor_keep_index(keep.detach().cpu(), batch, n).numpy()
        if keep.dtype == torch.bool:
            return index  # a mask cannot hold bad indices
    elif isinstance(keep, Sequence) and not isinstance(keep, (str, bytes)):
        if len(keep) != batch:
            raise ValueError(f"keep as a list needs one sequence of indices per request ({batch}), got {len(keep)}")
        rows = []
        for b, row in enumerate(keep):
            if isinstance(row, torch.Tensor):
                row = row.tolist()
            if not isinstance(row, Sequence) or any(isinstance(i, bool) or not isinstance(i, int) for i in row):
                raise ValueError(f"keep[{b}] must be a sequence of ints, got {row!r}")
            rows.append(list(row))
        index = np.full((batch, max((len(r) for r in rows), default=0)), -1, dtype=np.int64)
        for b, row in enumerate(rows):
            index[b, : len(row)] = row
    else:
        raise ValueError(f"keep must be None, an index/bool tensor or a list of index lists, got {type(keep).__name__}")
    if index.size:
        if index.min() < -1 or index.max() >= n:
            raise ValueError(
                f"keep indices must lie in [0, N = {n}) (or -1 for an unused slot), got {index.tolist()[:4]}"
            )
        valid = index >= 0
        # unused slots (-1) must come after every used one, and a row must not repeat an index
        if (valid[:, 1:] & ~valid[:, :-1]).any():
            raise ValueError("keep: -1 (unused) slots must come after the used ones in every row")
        if index.shape[1] > 1:
            s = np.sort(np.where(valid, index, -1 - np.arange(index.shape[1])[None]), axis=1)
            if (s[:, 1:] == s[:, :-1]).any():
                raise ValueError("keep: a request lists the same suffix index twice")
    return index

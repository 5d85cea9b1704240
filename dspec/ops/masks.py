"""pack_mask / unpack_mask / tree_mask: packed suffix masks for attention plans.

Layout (shared by every backend and by dspec.cascade_attention): ``words[..., q, w]`` int32
holds keys ``32 w .. 32 w + 31`` of query q; bit j (``1 << j``; bit 31 is the sign bit) is
key ``32 w + j``; bits past the last key are 0.
"""

from __future__ import annotations

import torch

from .. import _backend, _library, _validate
from ..reference import pack_mask as _ref_pack, tree_mask as _ref_tree
from ..types import TreeMask

PROVIDED = ("torch", "triton", "cuda", "cpp")
# The triton and cuda kernels keep one tree in one program / block (pointer jumping in
# registers / shared memory); the torch and cpp backends take any N.
TREE_MASK_MAX_NODES = 256


def pack_mask(mask: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Pack a boolean attention mask into 32-bit words, 32 keys per word.

    Parameters
    ----------
    mask : bool [..., Q, K] (any leading shape; at least one dimension)
        ``mask[..., q, k]``: query q may attend to key k.
    backend : "auto" | "torch" | "triton" | "cuda" | "cpp", optional

    Returns
    -------
    words : int32 [..., Q, ceil(K / 32)]; bit j of ``words[..., q, w]`` is
    ``mask[..., q, 32 w + j]`` (bit 31 is the sign bit); bits past K are 0.

    Example
    -------
    >>> import torch, dspec
    >>> dspec.pack_mask(torch.tensor([[True, False, True], [False, True, True]])).tolist()
    [[5], [6]]
    """
    _validate.tensor("mask", mask, min_dim=1, dtypes=(torch.bool,))
    name = _library.resolve("pack_mask", backend, mask.device, PROVIDED)
    if _library.call_directly(mask):
        return _pack_mask_impl(mask, name)
    return _library.pack_mask(mask, name)


@_library.body('pack_mask')
def _pack_mask_impl(mask: torch.Tensor, name: str) -> torch.Tensor:
    """Body of the ``dspec::pack_mask`` custom op: run backend ``name``."""
    if name == "torch":
        return _ref_pack.pack_mask(mask)
    if name == "triton":
        from ..kernels.pack_mask import pack_mask_triton

        return pack_mask_triton(mask)
    cuda = name == "cuda"
    keys = mask.shape[-1]
    out = torch.empty(*mask.shape[:-1], _ref_pack.num_words(keys), dtype=torch.int32, device=mask.device)
    if out.numel():
        m = _backend.as_rows(mask)
        with _backend.launch_context(m.device, cuda):
            _backend.extension().pack_mask(
                m.data_ptr(),
                m.shape[0],
                keys,
                m.stride(0),
                out.data_ptr(),
                "cuda" if cuda else "cpu",
                _backend.cuda_stream(m.device, cuda),
            )
    return out


def unpack_mask(words: torch.Tensor, num_keys: int, *, backend: str | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_mask`.

    Parameters
    ----------
    words : int32 [..., Q, W]
    num_keys : int, 0 <= num_keys <= 32 W; bits of keys >= num_keys are ignored.

    Returns
    -------
    mask : bool [..., Q, num_keys]

    Example
    -------
    >>> import torch, dspec
    >>> dspec.unpack_mask(torch.tensor([[5]], dtype=torch.int32), 3).tolist()
    [[True, False, True]]
    """
    _validate.tensor("words", words, min_dim=1, dtypes=(torch.int32,))
    if isinstance(num_keys, bool) or not isinstance(num_keys, int):
        raise ValueError(f"num_keys must be an int, got {num_keys!r}")
    capacity = 32 * words.shape[-1]
    if not 0 <= num_keys <= capacity:
        raise ValueError(
            f"num_keys must lie in [0, 32 * W] = [0, {capacity}] for words with W = {words.shape[-1]}, got {num_keys}"
        )
    name = _library.resolve("unpack_mask", backend, words.device, PROVIDED)
    if _library.call_directly(words):
        return _unpack_mask_impl(words, num_keys, name)
    return _library.unpack_mask(words, num_keys, name)


@_library.body('unpack_mask')
def _unpack_mask_impl(words: torch.Tensor, num_keys: int, name: str) -> torch.Tensor:
    """Body of the ``dspec::unpack_mask`` custom op: run backend ``name``."""
    if name == "torch":
        return _ref_pack.unpack_mask(words, num_keys)
    if name == "triton":
        from ..kernels.pack_mask import unpack_mask_triton

        return unpack_mask_triton(words, num_keys)
    cuda = name == "cuda"
    out = torch.empty(*words.shape[:-1], num_keys, dtype=torch.bool, device=words.device)
    if out.numel():
        w = _backend.as_rows(words)
        with _backend.launch_context(w.device, cuda):
            _backend.extension().unpack_mask(
                w.data_ptr(),
                w.shape[0],
                w.shape[1],
                w.stride(0),
                num_keys,
                out.data_ptr(),
                "cuda" if cuda else "cpu",
                _backend.cuda_stream(w.device, cuda),
            )
    return out


def tree_mask(parents: torch.Tensor, *, backend: str | None = None) -> TreeMask:
    """Ancestor masks and depths of token trees (D2SD's K+1 branches as one prefix tree).

    Parameters
    ----------
    parents : int32/int64 [B, N], as in :func:`dspec.verify_tree`: ``parents[b, 0] = -1``
        (node 0 is the root); for i >= 1 a parent in [0, i), or -1 for a padding node,
        which may not have children.  Checked before any launch (skipped when
        ``dspec.config.validate_values`` is off; a kernel then treats a parent outside
        [0, i) as -1).
    backend : "auto" | "torch" | "triton" | "cuda" | "cpp", optional.  The triton and cuda
        kernels take N <= 256 (one tree per program, pointer jumping in log2(N) rounds);
        "auto" falls back to torch beyond that, an explicit kernel backend raises.

    Returns
    -------
    TreeMask(words int32 [B, N, ceil(N / 32)], depth int64 [B, N]): node i's row has the
    bits of i and of its ancestors; depth counts edges to the root (0 at the root).  A
    padding node sees only itself and has depth 0.

    Example
    -------
    >>> import torch, dspec
    >>> words, depth = dspec.tree_mask(torch.tensor([[-1, 0, 1, 0]]))
    >>> words.tolist(), depth.tolist()
    ([[[1], [3], [7], [9]]], [[0, 1, 2, 1]])
    """
    _validate.tensor("parents", parents, dim=2, dtypes=_validate.ID_DTYPES)
    batch, nodes = parents.shape
    if nodes == 0:
        raise ValueError("parents must hold at least the root node (N >= 1)")
    _validate.tree_parents(parents, "parents")
    limits = None
    if nodes > TREE_MASK_MAX_NODES:
        why = (
            f"the {{}} backend takes N <= {TREE_MASK_MAX_NODES} nodes, got parents with N = {nodes}; "
            "use backend='torch' (or 'cpp' on CPU tensors)"
        )
        limits = {b: why.format(repr(b)) for b in ("triton", "cuda")}
    name = _library.resolve("tree_mask", backend, parents.device, PROVIDED, limits)
    if _library.call_directly(parents):
        return TreeMask(*_tree_mask_impl(parents, name))
    return TreeMask(*_library.tree_mask(parents, name))


@_library.body('tree_mask')
def _tree_mask_impl(parents: torch.Tensor, name: str):
    """Body of the ``dspec::tree_mask`` custom op: run backend ``name``."""
    if name == "torch":
        return tuple(_ref_tree.tree_mask(parents))
    if name == "triton":
        from ..kernels.tree_mask import tree_mask_triton

        return tuple(tree_mask_triton(parents))
    batch, nodes = parents.shape
    cuda = name == "cuda"
    words = torch.empty(batch, nodes, _ref_pack.num_words(nodes), dtype=torch.int32, device=parents.device)
    depth = torch.empty(batch, nodes, dtype=torch.int64, device=parents.device)
    if batch:
        par = _backend.as_rows(parents)  # rows apart by >= N ids (a broadcast gives stride 0)
        with _backend.launch_context(par.device, cuda):
            _backend.extension().tree_mask(
                par.data_ptr(),
                _backend.ID_CODE[par.dtype],
                batch,
                nodes,
                par.stride(0),
                words.data_ptr(),
                depth.data_ptr(),
                "cuda" if cuda else "cpu",
                _backend.cuda_stream(par.device, cuda),
            )
    return words, depth

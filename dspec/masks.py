"""Suffix-mask builders: one per verification shape of DESIGN.md's table.

Every method verifies drafts with one attention shape: a shared prefix (KV cached, seen by
every suffix token) plus a suffix of N new tokens under a custom mask.  The builders here
return that suffix mask packed (:func:`dspec.pack_mask` layout: ``words[q, w]`` bit j is
key ``32 w + j``) together with each suffix token's position, as an offset from the end of
the prefix (token i sits at absolute position ``prefix_len + positions[i]``).

Builders, by the verification shape they serve:

- :func:`causal`: an AR target verifying a chain (DiffuSpec, DFlash); causal drafts.
- :func:`prefix_tree`, :func:`d2sd_branches`, :func:`tree`: an AR target verifying K+1
  branches (D2SD) as one prefix tree; tree mask.
- :func:`ssd_copies`: SSD hierarchical verification; copies of the current block, each
  bidirectional within itself, none across.
- :func:`s2d2_two_l`: S2D2 2L verification; drafted span + an all-[MASK] copy.
- :func:`spiffy_draft_graph`: Spiffy's draft graph; real blocks + draft blocks, each draft
  block sees itself, not the block it replaces.
- :func:`block_diffusion`: a block-diffusion denoising step; one bidirectional block.

The pictures in the docstrings draw the dense mask: row = query, column = key,
``x`` = may attend, ``.`` = may not.  ``SuffixMask.dense()`` unpacks the words.

Every builder takes ``device=`` (default CPU) and raises ``ValueError`` naming the
argument on bad input.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import _validate
from .ops.masks import pack_mask, tree_mask, unpack_mask

__all__ = [
    "SuffixMask",
    "TreeSuffix",
    "block_diffusion",
    "causal",
    "d2sd_branches",
    "padded_prefix_tree",
    "prefix_tree",
    "s2d2_two_l",
    "spiffy_draft_graph",
    "ssd_copies",
    "tree",
]


class SuffixMask(NamedTuple):
    """A packed suffix mask and the positions of the suffix tokens.

    words: int32 [N, ceil(N / 32)] (or [B, N, ceil(N / 32)]), :func:`dspec.pack_mask`
    layout; positions: int64 [N] (or [B, N]), offsets from the end of the prefix.
    """

    words: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.words.shape[-2]

    def dense(self) -> torch.Tensor:
        """The mask as bool [..., N, N] (row = query, column = key)."""
        return unpack_mask(self.words, self.words.shape[-2])


class TreeSuffix(NamedTuple):
    """A token tree laid out as an attention suffix (D2SD's K+1 branches).

    tokens: int64 [N], node 0 is the root (the last committed token); parents: int64 [N]
    (-1 at the root and at padding nodes), directly usable by :func:`dspec.verify_tree`;
    words: int32 [N, ceil(N / 32)], node i sees itself and its ancestors
    (= :func:`dspec.tree_mask`); positions: int64 [N], the depth; leaf_of_branch: int64
    [K], the node where branch k ends (0 for an empty branch).  Batched: a leading [B]
    on every field, requests padded with padding nodes (parent -1, token ``pad_token``)
    and leaf_of_branch with -1.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    words: torch.Tensor
    positions: torch.Tensor
    leaf_of_branch: torch.Tensor

    @property
    def mask(self) -> SuffixMask:
        return SuffixMask(self.words, self.positions)

    def dense(self) -> torch.Tensor:
        return unpack_mask(self.words, self.words.shape[-2])


# ------------------------------------------------------------------------------------------
# argument checks


def _int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, torch.Tensor):
        _validate.not_meta(name, value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not value.is_floating_point()
        and value.dtype != torch.bool
    ):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _device(device) -> torch.device:
    return _validate.device("device", device, default="cpu")


def _numpy_to_list(name: str, value, ndim: int):
    """A numpy integer array of ``ndim`` dimensions as a (nested) list; anything else as is."""
    if type(value).__module__ == "numpy" and hasattr(value, "ndim") and hasattr(value, "dtype"):
        if value.ndim != ndim or value.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must be a {ndim}-D integer array, got dtype {value.dtype} and shape {list(value.shape)}"
            )
        return value.tolist()
    return value


def _int_list(name: str, values, *, minimum: int | None = 0) -> list[int]:
    """A sequence of ints (list, tuple, or 1-D integer tensor)."""
    if isinstance(values, torch.Tensor):
        _validate.not_meta(name, values)
        if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor or a sequence of ints, got "
                f"a {values.dtype} tensor of shape {list(values.shape)}"
            )
        values = values.tolist()
    values = _numpy_to_list(name, values, 1)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point():
            v = int(_validate.not_meta(f"{name}[{i}]", v))
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
        v = int(v)
        if minimum is not None and v < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {v}")
        out.append(v)
    return out


def _is_scalar(value) -> bool:
    """One request's root token (an int or a 0-d tensor), as opposed to a batch of them."""
    return isinstance(value, numbers.Integral) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _suffix(dense: torch.Tensor, positions: torch.Tensor, device) -> SuffixMask:
    dev = _device(device)
    return SuffixMask(pack_mask(dense).to(dev), positions.to(dev))


# ------------------------------------------------------------------------------------------
# fixed shapes


def causal(n: int, *, device=None) -> SuffixMask:
    """A chain of n drafted tokens verified by an AR target (DiffuSpec, DFlash).

    Token i sees tokens 0..i (and the whole prefix).  positions = arange(n).  n = 4::

              keys 0 1 2 3
        q 0        x . . .
        q 1        x x . .
        q 2        x x x .
        q 3        x x x x
        positions  0 1 2 3
    """
    n = _int("n", n)
    dense = torch.ones(n, n, dtype=torch.bool).tril()
    return _suffix(dense, torch.arange(n), device)


def block_diffusion(block_size: int, *, device=None) -> SuffixMask:
    """One block of a block-diffusion denoising step: bidirectional within the block.

    positions = arange(block_size).  block_size = 3::

              keys 0 1 2
        q 0        x x x
        q 1        x x x
        q 2        x x x
        positions  0 1 2
    """
    block_size = _int("block_size", block_size)
    dense = torch.ones(block_size, block_size, dtype=torch.bool)
    return _suffix(dense, torch.arange(block_size), device)


def ssd_copies(block_size: int, num_copies: int, *, device=None) -> SuffixMask:
    """SSD hierarchical verification: num_copies copies of the current block.

    N = num_copies * block_size; copy c occupies [c * block_size, (c + 1) * block_size),
    is bidirectional within itself and sees no other copy; every copy sits at positions
    arange(block_size).  block_size = 2, num_copies = 3::

              keys a0 a1 b0 b1 c0 c1
        a0         x  x  .  .  .  .
        a1         x  x  .  .  .  .
        b0         .  .  x  x  .  .
        b1         .  .  x  x  .  .
        c0         .  .  .  .  x  x
        c1         .  .  .  .  x  x
        positions  0  1  0  1  0  1
    """
    block_size = _int("block_size", block_size)
    num_copies = _int("num_copies", num_copies)
    copy = torch.arange(num_copies * block_size) // block_size
    dense = copy[:, None] == copy[None, :]
    return _suffix(dense, torch.arange(block_size).repeat(num_copies), device)


def s2d2_two_l(span: int, *, device=None) -> SuffixMask:
    """S2D2's 2L verification suffix: L drafted tokens, then L [MASK] copies.

    Drafts are token-causal (draft i sees drafts 0..i); mask copy i sits at draft i's
    position and sees the strictly earlier drafts 0..i-1 and itself only, so its logits
    are the model's prediction for position i given the drafts before it.
    positions = [arange(L), arange(L)].  span = L = 3::

              keys d0 d1 d2 m0 m1 m2
        d0         x  .  .  .  .  .
        d1         x  x  .  .  .  .
        d2         x  x  x  .  .  .
        m0         .  .  .  x  .  .
        m1         x  .  .  .  x  .
        m2         x  x  .  .  .  x
        positions  0  1  2  0  1  2
    """
    span = _int("span", span)
    idx = torch.arange(2 * span)
    q, k = idx[:, None], idx[None, :]
    draft_q, draft_k = q < span, k < span
    slot_q = torch.where(draft_q, q, q - span)
    dense = (draft_q & draft_k & (k <= q)) | (~draft_q & draft_k & (k < slot_q)) | (~draft_q & (k == q))
    return _suffix(dense, torch.arange(span).repeat(2), device)


def spiffy_draft_graph(
    block_size: int, replaces, num_real_blocks: int = 1, block_causal: bool = True, *, device=None
) -> SuffixMask:
    """Spiffy's draft graph: R real blocks, then D = len(replaces) draft blocks.

    Real blocks are bidirectional within themselves and block-causal across (real block r
    sees real blocks 0..r; with ``block_causal=False`` every real block sees every real
    block).  Draft block d stands in for real block k = replaces[d]: it sees itself
    (bidirectionally) and every real block except k (with ``block_causal``, only the real
    blocks before k), never another draft block; it sits at block k's positions.  Real
    block r sits at positions [r * block_size, (r + 1) * block_size).

    block_size = 2, replaces = [1, 1], num_real_blocks = 2 (blocks R0 R1, drafts D0 D1 of
    block 1)::

              keys R0 R0 R1 R1 D0 D0 D1 D1
        R0         x  x  .  .  .  .  .  .
        R0         x  x  .  .  .  .  .  .
        R1         x  x  x  x  .  .  .  .
        R1         x  x  x  x  .  .  .  .
        D0         x  x  .  .  x  x  .  .
        D0         x  x  .  .  x  x  .  .
        D1         x  x  .  .  .  .  x  x
        D1         x  x  .  .  .  .  x  x
        positions  0  1  2  3  2  3  2  3

    Parameters
    ----------
    block_size : int >= 1
    replaces : sequence of ints in [0, num_real_blocks) (repeats allowed; may be empty)
    num_real_blocks : int >= 1
    block_causal : bool
    """
    block_size = _int("block_size", block_size)
    num_real_blocks = _int("num_real_blocks", num_real_blocks)
    replaces = _int_list("replaces", replaces)
    for d, k in enumerate(replaces):
        if k >= num_real_blocks:
            raise ValueError(f"replaces[{d}] must lie in [0, num_real_blocks) = [0, {num_real_blocks}), got {k}")
    if not isinstance(block_causal, bool):
        raise ValueError(f"block_causal must be a bool, got {block_causal!r}")
    num_blocks = num_real_blocks + len(replaces)
    blk = torch.arange(num_blocks * block_size) // block_size
    real = blk < num_real_blocks
    # the real block each block stands for (itself for real blocks)
    stands_for = torch.tensor(list(range(num_real_blocks)) + replaces, dtype=torch.long)[blk]
    q_blk, k_blk = blk[:, None], blk[None, :]
    q_real, k_real = real[:, None], real[None, :]
    q_for = stands_for[:, None]
    if block_causal:
        real_real = k_blk <= q_blk
        draft_real = k_blk < q_for
    else:
        real_real = torch.ones_like(q_blk, dtype=torch.bool)
        draft_real = k_blk != q_for
    dense = (q_real & k_real & real_real) | (~q_real & k_real & draft_real) | (~q_real & ~k_real & (k_blk == q_blk))
    positions = stands_for * block_size + torch.arange(num_blocks * block_size) % block_size
    return _suffix(dense, positions, device)


# ------------------------------------------------------------------------------------------
# trees


def tree(parents, *, device=None, backend: str | None = None) -> SuffixMask:
    """The mask of a token tree given by its parents: :func:`dspec.tree_mask`.

    parents: int [N] (list or tensor) or [B, N], verify_tree's convention (root -1 at node
    0, parents before children, -1 for padding).  positions = depth.  With parents
    [-1, 0, 1, 0, 3] (root r, chain r-a-b, chain r-c-d)::

              keys r a b c d
        r          x . . . .
        a          x x . . .
        b          x x x . .
        c          x . . x .
        d          x . . x x
        positions  0 1 2 1 2

    A tensor stays on its device unless ``device`` is given; a list goes to ``device``
    (default CPU).
    """
    if isinstance(parents, torch.Tensor):
        t = parents
    else:
        try:
            t = torch.tensor(parents, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"parents must be a tensor or a (nested) list of ints, got {parents!r}") from None
    if t.dim() not in (1, 2):
        raise ValueError(f"parents must have shape [N] or [B, N], got {list(t.shape)}")
    if device is not None:
        t = t.to(_device(device))
    words, depth = tree_mask(t[None] if t.dim() == 1 else t, backend=backend)
    if t.dim() == 1:
        words, depth = words[0], depth[0]
    return SuffixMask(words, depth)


def _branches(name: str, value) -> list[list[int]]:
    if isinstance(value, torch.Tensor):
        _validate.not_meta(name, value)
        if value.dim() != 2 or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 2-D integer tensor or a list of token lists, got "
                f"a {value.dtype} tensor of shape {list(value.shape)}"
            )
        value = value.tolist()
    value = _numpy_to_list(name, value, 2)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of token lists, got {type(value).__name__}")
    return [_int_list(f"{name}[{k}]", branch) for k, branch in enumerate(value)]


def _trie(root_token: int, branches: list[list[int]]):
    """Insert the branches into a trie rooted at root_token: (tokens, parents, leaves)."""
    tokens, parents, leaves = [root_token], [-1], []
    children: list[dict[int, int]] = [{}]
    for branch in branches:
        node = 0
        for tok in branch:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                children.append({})
                children[node][tok] = nxt
            node = nxt
        leaves.append(node)
    return tokens, parents, leaves


def prefix_tree(sequences, root_token, *, pad_token: int = 0, device=None) -> TreeSuffix:
    """Merge token sequences that start after a common root into one prefix tree (a trie).

    D2SD verifies its K+1 branches as one tree: node 0 is the root (the last committed
    token, ``root_token``); each branch is a path from the root; branches sharing a
    prefix share its nodes.  Nodes are numbered in insertion order (branch 0's nodes
    first), so parents precede children and siblings never repeat a token: the result
    feeds :func:`dspec.verify_tree` (``tokens``, ``parents``) and the target's forward
    (``words``, ``positions`` = depth).

    Branches [[5, 6, 7], [5, 8], [9]] under root r::

        node   0  1  2  3  4  5            keys r 5 6 7 8 9
        token  r  5  6  7  8  9      r          x . . . . .
        parent -  0  1  2  1  0      5          x x . . . .
                                     6          x x x . . .
          r -- 5 -- 6 -- 7           7          x x x x . .
          |    `--- 8                8          x x . . x .
          `--- 9                     9          x . . . . x
                                     positions  0 1 2 3 2 1
        leaf_of_branch = [3, 4, 5]

    Parameters
    ----------
    sequences : one request: a list of branches, each a list (or 1-D tensor) of token ids
        (a 2-D tensor [K, M] is K branches of M tokens).  A batch: a list of such, one per
        request.
    root_token : int for one request; a list / 1-D tensor of B ints for a batch (this is
        what tells the two apart).
    pad_token : int, the token of the padding nodes that fill shorter requests of a batch
        (they see only themselves and no node sees them).
    device : where the result goes (default CPU).

    Returns
    -------
    TreeSuffix(tokens, parents, words, positions, leaf_of_branch); batched: each with a
    leading [B], padded to the largest tree (leaf_of_branch to the most branches, with -1).
    """
    pad_token = _int("pad_token", pad_token, minimum=0)
    dev = _device(device)
    batched = not _is_scalar(root_token)
    if batched:
        roots = _int_list("root_token", root_token)
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
            raise ValueError(
                f"sequences must be a list (one list of branches per request), got {type(sequences).__name__}"
            )
        if len(sequences) != len(roots):
            raise ValueError(f"sequences holds {len(sequences)} requests but root_token has {len(roots)} tokens")
        tries = [_trie(r, _branches(f"sequences[{b}]", s)) for b, (r, s) in enumerate(zip(roots, sequences))]
    else:
        roots = [_int("root_token", root_token, minimum=0)]
        tries = [_trie(roots[0], _branches("sequences", sequences))]
    batch = len(tries)
    nodes = max((len(t[0]) for t in tries), default=1)
    max_k = max((len(t[2]) for t in tries), default=0)
    tokens = torch.full((batch, nodes), pad_token, dtype=torch.long)
    parents = torch.full((batch, nodes), -1, dtype=torch.long)
    leaves = torch.full((batch, max_k), -1, dtype=torch.long)
    for b, (tok, par, leaf) in enumerate(tries):
        tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
        parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
        if leaf:
            leaves[b, : len(leaf)] = torch.tensor(leaf, dtype=torch.long)
    words, depth = tree_mask(parents)
    out = [tokens, parents, words, depth, leaves]
    if not batched:
        out = [t[0] for t in out]
    return TreeSuffix(*(t.to(dev) for t in out))


def padded_prefix_tree(branches, lengths, root_tokens, *, pad_token: int = 0, device=None) -> TreeSuffix:
    """:func:`prefix_tree` of a batch given as arrays, built with array ops (no loop over
    requests, branches or tokens): what a decode loop calls every cycle.

    branch k of request b is ``branches[b, k, :lengths[b, k]]`` (int [B, K, M]; lengths int
    [B, K] in [0, M]); ``root_tokens`` int [B].  Returns the batched :func:`prefix_tree` of
    those branches, node for node (insertion order: branch 0's nodes first), on ``device``.

    Two branches share a node at depth d exactly when their first d + 1 tokens are equal, so
    the node of (k, d) belongs to the first branch with that prefix, and nodes are numbered
    in (branch, depth) order, as the trie inserts them.
    """
    pad_token = _int("pad_token", pad_token, minimum=0)
    tensors = []
    for name, x in (("branches", branches), ("lengths", lengths), ("root_tokens", root_tokens)):
        if isinstance(x, torch.Tensor):
            _validate.not_meta(name, x)
        try:
            tensors.append(torch.as_tensor(x))
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be an integer tensor or array, got {type(x).__name__}") from None
    br, ln, roots = tensors
    for name, t, dim in (("branches", br, 3), ("lengths", ln, 2), ("root_tokens", roots, 1)):
        if t.dim() != dim or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a {dim}-D integer tensor, got {t.dtype} {list(t.shape)}")
    br, ln, roots = (t.detach().to("cpu", torch.int64) for t in (br, ln, roots))
    batch, k, m = br.shape
    if ln.shape != (batch, k) or roots.shape != (batch,):
        raise ValueError(
            f"lengths must be [B, K] = [{batch}, {k}] and root_tokens [B] = [{batch}], got "
            f"{list(ln.shape)} and {list(roots.shape)}"
        )
    if bool((ln < 0).any()) or bool((ln > m).any()):
        raise ValueError(f"lengths must lie in [0, M = {m}]")
    depth = torch.arange(m)
    valid = depth < ln[..., None]  # [B, K, M]
    if bool((br[valid] < 0).any()) or bool((roots < 0).any()):
        raise ValueError("branches (within lengths) and root_tokens must be token ids >= 0")
    # same[b, k, j, d]: branches k and j hold the same first d + 1 tokens
    same = torch.cumprod((br[:, :, None] == br[:, None]).to(torch.int64), -1).bool()
    same &= valid[:, :, None] & valid[:, None]
    owner = same.to(torch.int8).argmax(2)  # the first branch with that prefix
    is_node = valid & (owner == torch.arange(k)[None, :, None])
    flat = is_node.reshape(batch, k * m)
    ids = (torch.cumsum(flat, 1) * flat).view(batch, k, m)  # node ids of the owned (k, d), root = 0
    node = torch.where(valid, ids.gather(1, owner), 0)  # node id of every valid (k, d)
    parent = torch.cat([torch.zeros(batch, k, 1, dtype=torch.int64), node[..., :-1]], 2)
    nodes = int(flat.sum(1).max()) + 1 if batch else 1
    tokens = torch.full((batch, nodes), pad_token, dtype=torch.int64)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    tokens[:, 0] = roots
    b_idx = torch.arange(batch)[:, None, None].expand(batch, k, m)
    tokens[b_idx[is_node], ids[is_node]] = br[is_node]
    parents[b_idx[is_node], ids[is_node]] = parent[is_node]
    last = (ln - 1).clamp(min=0)
    leaves = torch.where(ln > 0, node.gather(2, last[..., None])[..., 0], 0)
    words, positions = tree_mask(parents)
    dev = _device(device)
    return TreeSuffix(*(t.to(dev) for t in (tokens, parents, words, positions, leaves)))


def d2sd_branches(root_token, first_draft, prefix_lengths, redrafts, *, pad_token: int = 0, device=None) -> TreeSuffix:
    """D2SD's K+1 branches as one prefix tree.

    Branch 0 is the first draft; branch k + 1 (k = 0..K-1) keeps the first
    ``prefix_lengths[k]`` tokens of the first draft and continues with ``redrafts[k]``
    (the re-draft anchored at that rejection boundary, e.g. from
    :func:`dspec.rejection_boundaries`).  Returns :func:`prefix_tree` of the K+1 branches,
    so ``leaf_of_branch`` has K+1 entries.

    first_draft [a b c], prefix_lengths [1, 0], redrafts [[x y], [z]] -> branches
    [a b c], [a x y], [z]::

        r -- a -- b -- c
        |    `--- x -- y
        `--- z

    Parameters
    ----------
    root_token : int (one request) or [B] (a batch)
    first_draft : [L] ints (or [B, L])
    prefix_lengths : [K] ints in [0, L] (or [B, K])
    redrafts : K token lists (ragged allowed) or a [K, M] tensor (or a batch of those)
    """
    batched = not _is_scalar(root_token)
    if not batched:
        root_token = _int("root_token", root_token, minimum=0)
        first = _int_list("first_draft", first_draft)
        lengths = _int_list("prefix_lengths", prefix_lengths)
        redr = _branches("redrafts", redrafts)
        return prefix_tree(_d2sd_list(first, lengths, redr), root_token, pad_token=pad_token, device=device)
    roots = _int_list("root_token", root_token)
    batch = len(roots)
    for name, value in (("first_draft", first_draft), ("prefix_lengths", prefix_lengths), ("redrafts", redrafts)):
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)):
            raise ValueError(f"{name} must be a list or tensor with one entry per request, got {type(value).__name__}")
        if len(value) != batch:
            raise ValueError(f"{name} must have one entry per request ({batch}), got {len(value)}")
    sequences = [
        _d2sd_list(
            _int_list(f"first_draft[{b}]", first_draft[b]),
            _int_list(f"prefix_lengths[{b}]", prefix_lengths[b]),
            _branches(f"redrafts[{b}]", redrafts[b]),
            where=f"[{b}]",
        )
        for b in range(batch)
    ]
    return prefix_tree(sequences, roots, pad_token=pad_token, device=device)


def _d2sd_list(first: list[int], lengths: list[int], redrafts: list[list[int]], where: str = ""):
    if len(redrafts) != len(lengths):
        raise ValueError(
            f"redrafts{where} must hold one re-draft per prefix length ({len(lengths)}), got {len(redrafts)}"
        )
    for k, n in enumerate(lengths):
        if n > len(first):
            raise ValueError(f"prefix_lengths{where}[{k}] must lie in [0, L] = [0, {len(first)}], got {n}")
    return [first] + [first[:n] + r for n, r in zip(lengths, redrafts)]

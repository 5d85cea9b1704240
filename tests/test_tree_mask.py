"""tree_mask: ancestor masks and depths of token trees, every backend against a node-by-node
oracle (random trees, chains, stars, padding; N up to 256; batch 1 and 7; int32 and int64
parents), the N limit of the kernel backends, the tree checks, and _C's argument checks."""

import functools
import random

import pytest
import torch

import dspec
from conftest import device_backends
from dspec import _backend
from dspec.ops import masks as ops_masks
from dspec.reference.pack_mask import pack_mask as ref_pack
from dspec.reference.tree_mask import tree_mask as ref_tree


def oracle(parents: torch.Tensor):
    """Walk every node up to the root (what the kernels must not do): dense mask and depth."""
    batch, nodes = parents.shape
    dense = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
    depth = torch.zeros(batch, nodes, dtype=torch.int64)
    par = parents.tolist()
    for b in range(batch):
        for i in range(nodes):
            u, d = i, 0
            dense[b, i, i] = True
            while u > 0 and par[b][u] >= 0:
                u = par[b][u]
                dense[b, i, u] = True
                d += 1
            depth[b, i] = d
    return dense, depth


def make_tree(kind: str, nodes: int, rng: random.Random):
    par = [-1] * nodes
    for i in range(1, nodes):
        if kind == "chain":
            par[i] = i - 1
        elif kind == "star":
            par[i] = 0
        elif kind == "random":
            par[i] = rng.randrange(i)
        elif kind == "deep":  # mostly a chain with short side branches
            par[i] = i - 1 if rng.random() < 0.8 else rng.randrange(i)
        elif kind == "padding":  # a random tree over some nodes, the others padding
            live = [j for j in range(i) if j == 0 or par[j] >= 0]
            par[i] = -1 if rng.random() < 0.3 else rng.choice(live)
        else:
            raise AssertionError(kind)
    return par


KINDS = ("chain", "star", "random", "deep", "padding")
NODES = [1, 7, 33, 64, 130, 256]


@functools.lru_cache(maxsize=None)
def case(nodes: int, batch: int, seed: int):
    rng = random.Random(nodes * 1000 + batch * 10 + seed)
    rows = [make_tree(KINDS[(seed + b) % len(KINDS)], nodes, rng) for b in range(batch)]
    parents = torch.tensor(rows, dtype=torch.int64)
    dense, depth = oracle(parents)
    return parents, ref_pack(dense), depth


@device_backends()
@pytest.mark.parametrize("nodes", NODES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_matches_oracle(device, backend, nodes, dtype):
    for batch in (1, 7):
        for seed in range(len(KINDS) if batch == 1 else 2):
            parents, words, depth = case(nodes, batch, seed)
            out = dspec.tree_mask(parents.to(dtype).to(device), backend=backend)
            assert isinstance(out, dspec.TreeMask)
            assert out.words.dtype == torch.int32 and out.depth.dtype == torch.int64
            assert out.words.shape == (batch, nodes, (nodes + 31) // 32)
            assert out.words.device == parents.to(device).device
            assert torch.equal(out.words.cpu(), words), (nodes, batch, seed)
            assert torch.equal(out.depth.cpu(), depth), (nodes, batch, seed)


@device_backends()
def test_small_cases_by_hand(device, backend):
    par = torch.tensor([[-1, 0, 1, 0, -1, 3]], device=device)
    words, depth = dspec.tree_mask(par, backend=backend)
    # node 4 is padding: only itself, depth 0
    assert words.cpu()[0, :, 0].tolist() == [1, 3, 7, 9, 16, 41]
    assert depth.cpu().tolist() == [[0, 1, 2, 1, 0, 2]]
    words, depth = dspec.tree_mask(torch.tensor([[-1]], device=device), backend=backend)
    assert words.cpu().tolist() == [[[1]]] and depth.cpu().tolist() == [[0]]
    # a 33-chain: node 32's row has every bit of word 0 (sign bit included) and bit 0 of word 1
    chain = torch.tensor([[-1] + list(range(32))], device=device)
    words, depth = dspec.tree_mask(chain, backend=backend)
    assert words.cpu()[0, 32].tolist() == [-1, 1]
    assert words.cpu()[0, 31].tolist() == [-1, 0]
    assert words.cpu()[0, 30].tolist() == [2**31 - 1, 0]
    assert depth.cpu()[0, 32].item() == 32


@device_backends()
def test_strided_parents_and_empty_batch(device, backend):
    parents, words, depth = case(33, 7, 0)
    wide = torch.full((7, 80), -1, dtype=torch.int64)
    wide[:, 5:38] = parents
    view = wide.to(device)[:, 5:38]
    assert view.stride(0) == 80
    out = dspec.tree_mask(view, backend=backend)
    assert torch.equal(out.words.cpu(), words) and torch.equal(out.depth.cpu(), depth)
    col = parents.t().contiguous().to(device).t()  # unit stride along the batch, not the nodes
    out = dspec.tree_mask(col, backend=backend)
    assert torch.equal(out.words.cpu(), words) and torch.equal(out.depth.cpu(), depth)
    empty = dspec.tree_mask(torch.empty(0, 5, dtype=torch.int64, device=device), backend=backend)
    assert empty.words.shape == (0, 5, 1) and empty.depth.shape == (0, 5)


@device_backends()
def test_unchecked_parents_are_clamped_alike(device, backend, monkeypatch):
    """With value checks off, a parent outside [0, i) counts as -1 on every backend."""
    monkeypatch.setattr(dspec.config, "validate_values", False)
    par = torch.tensor([[5, 0, 7, -3, 1, 4, 2, 100, 6]], device=device)
    words, depth = dspec.tree_mask(par, backend=backend)
    ref_words, ref_depth = ref_tree(par.cpu())
    assert torch.equal(words.cpu(), ref_words) and torch.equal(depth.cpu(), ref_depth)
    clamped = torch.tensor([[-1, 0, -1, -1, 1, 4, 2, -1, 6]])
    dense, want_depth = oracle(clamped)
    assert torch.equal(words.cpu(), ref_pack(dense)) and torch.equal(depth.cpu(), want_depth)
    # int64 values that would look like valid parents if narrowed to int32 first
    huge = torch.tensor([[-1, 0, 2**32 + 1, 2**32, -(2**32) + 1]], device=device)
    words, depth = dspec.tree_mask(huge, backend=backend)
    assert depth.cpu().tolist() == [[0, 1, 0, 0, 0]]
    assert words.cpu()[0, :, 0].tolist() == [1, 3, 4, 8, 16]


def test_large_trees_beyond_kernel_limit():
    rng = random.Random(0)
    parents = torch.tensor([make_tree("deep", 300, rng), make_tree("random", 300, rng)])
    dense, depth = oracle(parents)
    for backend in ("torch", "auto") + (("cpp",) if _backend.cpp_available() else ()):
        out = dspec.tree_mask(parents, backend=backend)
        assert torch.equal(out.words, ref_pack(dense)) and torch.equal(out.depth, depth)
    kernel_cases = []
    if _backend.triton_available() and _backend.triton_interpret():
        kernel_cases.append(("cpu", "triton"))
    if torch.cuda.is_available():
        kernel_cases += [("cuda", b) for b in ("triton", "cuda") if _backend.backend_ready(b)]
    for dev, b in kernel_cases:
        with pytest.raises(ValueError, match="N <= 256"):
            dspec.tree_mask(parents.to(dev), backend=b)
    ok = dspec.tree_mask(parents[:, :256])  # the limit itself is fine
    assert ok.words.shape == (2, 256, 8)


def test_auto_falls_back_to_torch_beyond_kernel_limit(monkeypatch):
    """On a GPU, auto (and a $DSPEC_BACKEND preference) would pick a kernel: past 256 nodes
    the resolver skips the kernels; an explicit backend= raises."""
    from dspec import _backend

    monkeypatch.setattr(_backend, "backend_ready", lambda name: True)
    limits = {b: f"the {b!r} backend takes N <= 256 nodes" for b in ("triton", "cuda")}
    cuda = torch.device("cuda")
    monkeypatch.delenv("DSPEC_BACKEND", raising=False)
    assert _backend.resolve("tree_mask", None, cuda, ("torch", "triton", "cuda", "cpp"), limits) == "torch"
    with pytest.raises(ValueError, match="N <= 256"):
        _backend.resolve("tree_mask", "cuda", cuda, ("torch", "triton", "cuda", "cpp"), limits)
    monkeypatch.setenv("DSPEC_BACKEND", "cuda")
    assert _backend.resolve("tree_mask", None, cuda, ("torch", "triton", "cuda", "cpp"), limits) == "torch"
    parents = torch.tensor([[-1] + list(range(299))])
    assert dspec.tree_mask(parents).depth[0, -1].item() == 299
    with pytest.raises(ValueError, match="N <= 256"):
        dspec.tree_mask(parents, backend="cuda")


@pytest.mark.parametrize(
    "parents,match",
    [
        (torch.tensor([[0, 0, 1]]), r"parents\[0, 0\] must be -1"),
        (torch.tensor([[-1, 0, 2]]), "not a topologically ordered tree"),
        (torch.tensor([[-1, 0, 5]]), "not a topologically ordered tree"),
        (torch.tensor([[-1, -2, 0]]), "not a topologically ordered tree"),
        (torch.tensor([[-1, -1, 1]]), "points at a padding node"),
        (torch.tensor([[-1, 0], [-1, 1]]), r"parents\[1, 1\]"),
        (torch.tensor([-1, 0, 1]), "parents must have 2 dimensions"),
        (torch.tensor([[-1.0, 0.0]]), "parents must have dtype"),
        (torch.empty(2, 0, dtype=torch.int64), "at least the root"),
        ([[-1, 0]], "parents must be a torch.Tensor"),
    ],
)
def test_invalid_trees_raise(parents, match):
    with pytest.raises(ValueError, match=match):
        dspec.tree_mask(parents)


def test_verify_tree_uses_the_same_check():
    logits = torch.zeros(1, 3, 5)
    with pytest.raises(ValueError, match="points at a padding node"):
        dspec.verify_tree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, -1, 1]]), logits)


def test_reference_rounds_reach_the_deepest_node():
    for nodes in (2, 3, 4, 5, 17, 32, 33, 257, 513):
        chain = torch.tensor([[-1] + list(range(nodes - 1))])
        words, depth = ref_tree(chain)
        assert depth[0, -1].item() == nodes - 1
        assert torch.equal(words, ref_pack(torch.ones(nodes, nodes, dtype=torch.bool).tril()[None]))


# ------------------------------------------------------------------------------------------
# dspec._C directly

needs_ext = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C is not built")


@needs_ext
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(parents_ptr=0), "parents_ptr"),
        (dict(words_ptr=0), "words_ptr"),
        (dict(depth_ptr=0), "depth_ptr"),
        (dict(depth_ptr=4), "depth_ptr"),  # misaligned, filled in below
        (dict(dtype=2), "dtype"),
        (dict(batch=-1), "batch"),
        (dict(nodes=0), "nodes"),
        (dict(row_stride=3), "row_stride"),
        (dict(device="tpu"), "device"),
    ],
)
def test_ext_tree_rejects_bad_arguments_before_writing(bad, match):
    ext = _backend.extension()
    parents = torch.tensor([[-1, 0, 1, 0, 3]] * 2)
    words = torch.full((2, 5, 1), 77, dtype=torch.int32)
    depth = torch.full((2, 5), 77, dtype=torch.int64)
    kwargs = dict(
        parents_ptr=parents.data_ptr(),
        dtype=ext.INDEX_INT64,
        batch=2,
        nodes=5,
        row_stride=5,
        words_ptr=words.data_ptr(),
        depth_ptr=depth.data_ptr(),
        device="cpu",
        stream=0,
    )
    kwargs.update(bad)
    if bad.get("depth_ptr") == 4:
        kwargs["depth_ptr"] = depth.data_ptr() + 4
    with pytest.raises(ValueError, match=match):
        ext.tree_mask(**kwargs)
    assert bool((words == 77).all()) and bool((depth == 77).all())
    ext.tree_mask(parents.data_ptr(), ext.INDEX_INT64, 2, 5, 5, words.data_ptr(), depth.data_ptr(), "cpu")
    assert depth.tolist() == [[0, 1, 2, 1, 2]] * 2


@needs_ext
def test_ext_constants():
    ext = _backend.extension()
    assert ext.tree_mask_max_nodes == ops_masks.TREE_MASK_MAX_NODES == 256
    assert (ext.INDEX_INT32, ext.INDEX_INT64) == (0, 1)


# ------------------------------------------------------------------------------------------
# the CUDA kernel (csrc/tree_mask.cu) in the host simulator of tests/cuda_sim

from masks_sim import sim_tree  # noqa: E402  (the masks_sim fixture: conftest.py)


@pytest.mark.parametrize("nodes", NODES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_cuda_kernel_in_simulator(masks_sim, nodes, dtype):
    for batch, seeds in ((1, range(len(KINDS))), (7, range(1))):
        for seed in seeds:
            parents, words, depth = case(nodes, batch, seed)
            got_words, got_depth = sim_tree(masks_sim, parents.to(dtype))
            assert torch.equal(got_words, words), (nodes, batch, seed)
            assert torch.equal(got_depth, depth), (nodes, batch, seed)


def test_cuda_kernel_in_simulator_unchecked_and_strided(masks_sim):
    par = torch.tensor([[5, 0, 7, -3, 1, 4, 2, 100, 6], [-1, 0, 2**32 + 1, 2**32, 1, 1, 5, 6, 0]])
    words, depth = sim_tree(masks_sim, par)
    ref_words, ref_depth = ref_tree(par)
    assert torch.equal(words, ref_words) and torch.equal(depth, ref_depth)
    parents, want_words, want_depth = case(33, 7, 1)
    wide = torch.full((7, 50), -1, dtype=torch.int64)
    wide[:, 3:36] = parents
    words, depth = sim_tree(masks_sim, wide[:, 3:36])
    assert torch.equal(words, want_words) and torch.equal(depth, want_depth)

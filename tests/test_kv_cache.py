"""dspec.models.KVCache: commit / rollback equal recomputation from scratch; ragged batches.

No transformers here: the reference is always a fresh forward of the committed sequence
without any cache.
"""

from __future__ import annotations

import pytest
import torch

import dspec
from dspec.models import AttentionPlan, KVCache, SuffixKV, load_checkpoint
from tiny_checkpoints import write_checkpoint

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    return {fam: load_checkpoint(write_checkpoint(root / fam, fam, seed=7)) for fam in ("llama", "qwen3", "sdar")}


def _ids(n, seed, vocab=160):
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh(model, seq):
    """Logits [len, V] and suffix K/V of one causal forward of ``seq`` with no cache."""
    out = model(model.plan([seq]))
    return out.logits[0], out.suffix_kv


def _assert_cache_holds(model, cache, b, seq):
    """Request b's committed rows equal the K/V of a fresh forward of ``seq``."""
    _, kv = _fresh(model, seq)
    assert int(cache.lengths[b]) == len(seq)
    for layer in range(model.config.num_layers):
        k, v = cache.get(layer, b)
        torch.testing.assert_close(k, kv.keys[layer][0], **TOL)
        torch.testing.assert_close(v, kv.values[layer][0], **TOL)


# ------------------------------------------------------------------ against recomputation


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_commit_equals_recomputation(models, family):
    model = models[family]
    prompt = _ids(9, 1)
    cache = model.new_cache(1)
    cache.append(model(model.plan([prompt[:-1]], cache)).suffix_kv)  # the last token is the root
    # root r; r-a-b-c, r-d-e, a-f: verify the tree in one forward
    parents = [-1, 0, 1, 2, 0, 4, 1]
    tree_tokens = [prompt[-1]] + _ids(6, 2)
    tree = dspec.masks.tree(parents)
    plan = AttentionPlan.from_offsets(torch.tensor([tree_tokens]), tree.positions, tree.words, cache)
    assert plan.positions.tolist() == [[8, 9, 10, 11, 9, 10, 10]]
    out = model(plan)
    # each branch's logits equal a fresh forward of the prompt followed by that branch
    for path in ([0, 1, 2, 3], [0, 4, 5], [0, 1, 6]):
        seq = prompt[:-1] + [tree_tokens[i] for i in path]
        fresh, _ = _fresh(model, seq)
        torch.testing.assert_close(out.logits[0, path], fresh[len(prompt) - 1 :], **TOL)
    # commit the root and the accepted path r-a-f; the cache then holds exactly that sequence
    accepted = torch.tensor([[1, 6, -1, -1]])  # verify_tree's path layout
    keep = torch.cat([torch.zeros(1, 1, dtype=torch.long), accepted], 1)
    assert cache.append(out.suffix_kv, keep).tolist() == [3]
    committed = prompt + [tree_tokens[1], tree_tokens[6]]
    _assert_cache_holds(model, cache, 0, committed)
    # and the next forward over the cache equals a fresh forward of everything
    nxt = _ids(3, 3)
    step = model(model.plan([nxt], cache))
    fresh, _ = _fresh(model, committed + nxt)
    torch.testing.assert_close(step.logits[0], fresh[len(committed) :], **TOL)


def test_chain_accepted_prefix_and_rollback(models):
    model = models["llama"]
    prompt, drafts = _ids(7, 4), _ids(5, 5)
    cache = model.new_cache(1, capacity=4)  # grows while appending
    cache.append(model(model.plan([prompt], cache)).suffix_kv)
    chain = model(model.plan([drafts], cache))
    cache.append(chain.suffix_kv, counts=[2])  # accept 2 drafts
    _assert_cache_holds(model, cache, 0, prompt + drafts[:2])
    cache.append(chain.suffix_kv, keep=[[]])  # nothing
    assert cache.lengths.tolist() == [9]
    cache.rollback(0, 4)
    _assert_cache_holds(model, cache, 0, prompt[:5])
    nxt = _ids(4, 6)
    step = model(model.plan([nxt], cache))
    fresh, _ = _fresh(model, prompt[:5] + nxt)
    torch.testing.assert_close(step.logits[0], fresh[5:], **TOL)
    cache.crop(3)
    _assert_cache_holds(model, cache, 0, prompt[:3])
    cache.reset()
    assert cache.lengths.tolist() == [0] and cache.max_length == 0


def test_batch_of_three_ragged_prompts_equals_three_single_runs(models):
    model = models["qwen3"]
    prompts = [_ids(5, 10), _ids(11, 11), _ids(1, 12)]
    steps = [_ids(3, 20), _ids(3, 21), _ids(3, 22)]
    # batched: right-padded prefill, commit the valid part, then a 3-token chain each,
    # accept a different number per request, then one more token each
    cache = model.new_cache(3)
    plan = model.plan(prompts, cache)
    prefill = model(plan, logits="last")
    cache.append(prefill.suffix_kv, counts=plan.lengths)
    assert cache.lengths.tolist() == [5, 11, 1]
    chain = model(model.plan(steps, cache))
    cache.append(chain.suffix_kv, counts=[3, 0, 2])
    final = model(AttentionPlan.from_offsets(torch.tensor([[7], [8], [9]]), [0], None, cache))
    for b in range(3):
        single = model.new_cache(1)
        p1 = model(model.plan([prompts[b]], single), logits="last")
        torch.testing.assert_close(prefill.logits[b], p1.logits[0], **TOL)
        single.append(p1.suffix_kv)
        c1 = model(model.plan([steps[b]], single))
        torch.testing.assert_close(chain.logits[b], c1.logits[0], **TOL)
        single.append(c1.suffix_kv, counts=[[3, 0, 2][b]])
        f1 = model(AttentionPlan.from_offsets(torch.tensor([[7 + b]]), [0], None, single))
        torch.testing.assert_close(final.logits[b], f1.logits[0], **TOL)
        _assert_cache_holds(model, cache, b, prompts[b] + steps[b][: [3, 0, 2][b]])


def test_block_diffusion_commit_equals_recomputation(models):
    """SDAR-style: commit a denoised block; the next block over the cache equals one
    block-causal forward of everything."""
    model = models["sdar"]
    bs = model.block_size
    prompt, block1, block2 = _ids(2 * bs, 30), _ids(bs, 31), _ids(bs, 32)
    cache = model.new_cache(1)
    cache.append(model(model.plan([prompt], cache)).suffix_kv)
    step = dspec.masks.block_diffusion(bs)
    noisy = [model.mask_token_id] * bs
    model(AttentionPlan.from_offsets(torch.tensor([noisy]), step.positions, step.words, cache))
    out = model(AttentionPlan.from_offsets(torch.tensor([block1]), step.positions, step.words, cache))
    cache.append(out.suffix_kv)  # the whole block
    nxt = model(AttentionPlan.from_offsets(torch.tensor([block2]), step.positions, step.words, cache))
    fresh = model(model.plan([prompt + block1 + block2]))
    torch.testing.assert_close(nxt.logits[0], fresh.logits[0, 3 * bs :], **TOL)
    torch.testing.assert_close(out.logits[0], fresh.logits[0, 2 * bs : 3 * bs], **TOL)


def test_ragged_and_paged_layouts_agree(models):
    model = models["llama"]
    prompts = [_ids(6, 40), _ids(2, 41), _ids(9, 42)]
    outs = []
    for layout in ("ragged", "paged"):
        cache = model.new_cache(3, layout=layout)
        assert cache.resolved_layout == layout
        plan = model.plan(prompts, cache)
        cache.append(model(plan).suffix_kv, counts=plan.lengths)
        prefix = cache.prefix(0)
        assert ("prefix_indptr" in prefix) is (layout == "ragged")
        outs.append(model(model.plan([[5, 6], [7, 8], [9, 10]], cache)).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# ------------------------------------------------------------------ the cache itself


def _kv(layers=2, batch=2, n=5, hkv=1, d=2, offset=0.0):
    keys = [
        torch.arange(batch * n * hkv * d, dtype=torch.float32).view(batch, n, hkv, d) + 100 * l + offset
        for l in range(layers)
    ]
    return SuffixKV(keys, [-k for k in keys])


def _rows(cache, layer, b):
    return cache.get(layer, b)[0][:, 0, 0].tolist()


def test_append_keep_forms():
    kv = _kv()  # row b token i has key value (b * 5 + i) * 2 (+100 per layer)
    forms = {
        "index": torch.tensor([[4, 1, -1], [0, 2, 3]]),
        "bool": torch.tensor([[False, True, False, False, True], [True, False, True, True, False]]),
        "list": [[4, 1], [0, 2, 3]],
    }
    expect = {"index": ([8, 2], [10, 14, 16]), "bool": ([2, 8], [10, 14, 16]), "list": ([8, 2], [10, 14, 16])}
    for name, keep in forms.items():
        cache = KVCache(2, 2, 1, 2, capacity=1)
        assert cache.append(kv, keep).tolist() == [2, 3]
        assert (_rows(cache, 0, 0), _rows(cache, 0, 1)) == expect[name], name
        assert _rows(cache, 1, 1) == [110, 114, 116]
        torch.testing.assert_close(cache.get(1, 0)[1], -cache.get(1, 0)[0])
    cache = KVCache(2, 2, 1, 2)
    cache.append(kv, torch.tensor([3]))  # [K] shared by every request
    cache.append(kv, counts=[1, 2])
    assert _rows(cache, 0, 0) == [6, 0] and _rows(cache, 0, 1) == [16, 10, 12]
    cache.append(kv)  # everything
    assert cache.lengths.tolist() == [7, 8] and cache.capacity >= 8
    assert _rows(cache, 0, 1)[3:] == [10, 12, 14, 16, 18]


def test_growth_select_clone_crop():
    kv = _kv(batch=3, n=20)
    cache = KVCache(2, 3, 1, 2, capacity=0)
    assert cache.capacity == 0
    for _ in range(3):
        cache.append(kv, counts=[20, 5, 0])
    assert cache.lengths.tolist() == [60, 15, 0] and cache.capacity >= 60
    assert _rows(cache, 0, 0) == [(i % 20) * 2 for i in range(60)]
    sub = cache.select([2, 0])
    assert sub.batch_size == 2 and sub.lengths.tolist() == [0, 60]
    assert _rows(sub, 1, 1) == _rows(cache, 1, 0)
    copy = cache.clone()
    copy.crop([10, 3, 0])
    assert copy.lengths.tolist() == [10, 3, 0] and cache.lengths.tolist() == [60, 15, 0]
    cache.crop(12)
    assert cache.lengths.tolist() == [12, 12, 0]
    cache.rollback(1, 12)
    assert cache.lengths.tolist() == [12, 0, 0]
    idx, indptr = cache._ragged_meta()
    assert indptr.tolist() == [0, 12, 12, 12] and idx.tolist() == list(range(12))


def test_cache_rejects_bad_input():
    cache = KVCache(2, 2, 1, 2)
    kv = _kv()
    with pytest.raises(ValueError, match="suffix_kv must be a SuffixKV"):
        cache.append((kv.keys, kv.values))
    with pytest.raises(ValueError, match="suffix_kv has 3 layers"):
        cache.append(_kv(layers=3))
    with pytest.raises(ValueError, match="the cache expects B = 2"):
        cache.append(_kv(batch=3))
    with pytest.raises(ValueError, match=r"keep indices must lie in \[0, N = 5\)"):
        cache.append(kv, torch.tensor([[0, 5], [0, 1]]))
    with pytest.raises(ValueError, match="must come after the used ones"):
        cache.append(kv, torch.tensor([[-1, 1], [0, 1]]))
    with pytest.raises(ValueError, match="same suffix index twice"):
        cache.append(kv, [[1, 1], [0]])
    with pytest.raises(ValueError, match="bool keep mask must have shape"):
        cache.append(kv, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="one sequence of indices per request"):
        cache.append(kv, [[1]])
    with pytest.raises(ValueError, match="give keep or counts"):
        cache.append(kv, [[1], [1]], counts=[1, 1])
    with pytest.raises(ValueError, match=r"counts must lie in \[0, N = 5\]"):
        cache.append(kv, counts=[6, 0])
    with pytest.raises(ValueError, match="float16"):
        cache.append(SuffixKV([k.half() for k in kv.keys], [v.half() for v in kv.values]))
    assert cache.lengths.tolist() == [0, 0]  # nothing half-done
    cache.append(kv, counts=[2, 1])
    with pytest.raises(ValueError, match=r"n must be an int in \[0, 1\]"):
        cache.rollback(1, 2)
    with pytest.raises(ValueError, match="b must be a request index"):
        cache.rollback(2, 0)
    with pytest.raises(ValueError, match="lengths must lie in"):
        cache.crop([3, 0])
    with pytest.raises(ValueError, match="one per request"):
        cache.crop([1])
    with pytest.raises(ValueError, match="indices must be"):
        cache.select([2])
    with pytest.raises(ValueError, match="layout must be"):
        KVCache(1, 1, 1, 2, layout="dense")
    with pytest.raises(ValueError, match="batch_size must be"):
        KVCache(1, 0, 1, 2)


def test_triton_backend_runs_the_model(models):
    """The model's attention through the Triton kernel (the interpreter on CPU, the GPU
    when there is one), over a ragged and a paged prefix, equals the torch reference."""
    from dspec import _backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not _backend.triton_available() or (device == "cpu" and not _backend.triton_interpret()):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    model = models["qwen3"].to(device)
    try:
        prompts = [_ids(5, 50), _ids(9, 51)]
        tree = dspec.masks.tree([-1, 0, 1, 0])
        outs = {}
        for layout, backend in (("ragged", "torch"), ("ragged", "triton"), ("paged", "triton")):
            cache = model.new_cache(2, layout=layout)
            plan = model.plan(prompts, cache)
            cache.append(model(plan, backend=backend).suffix_kv, counts=plan.lengths)
            tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device=device)
            plan = AttentionPlan.from_offsets(tokens, tree.positions.to(device), tree.words.to(device), cache)
            outs[layout, backend] = model(plan, backend=backend).logits
        ref = outs["ragged", "torch"]
        torch.testing.assert_close(outs["ragged", "triton"], ref, **TOL)
        torch.testing.assert_close(outs["paged", "triton"], ref, **TOL)
    finally:
        model.to("cpu")


def test_stacked_suffix_kv_commits_like_its_lists():
    """SuffixKV(stacked=...) (the one-call layer stack's output) commits exactly what the
    per-layer lists commit; the lists are views of it."""
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(2, 3, 2, 5, 2, 8, generator=g)
    a, b = KVCache(3, 2, 2, 8), KVCache(3, 2, 2, 8)
    both = SuffixKV(stacked=stacked)
    assert both.num_layers == 3 and both.shape == (2, 5, 2, 8) and torch.equal(both.values[1], stacked[1, 1])
    a.append(SuffixKV(stacked=stacked), counts=[5, 3])
    b.append(SuffixKV(list(stacked[0].unbind(0)), list(stacked[1].unbind(0))), counts=[5, 3])
    for i in range(3):
        for x, y in zip(a.layer_rows(i), b.layer_rows(i)):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="stacked"):
        SuffixKV(stacked=torch.zeros(3, 1, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="layers"):
        KVCache(2, 2, 2, 8).append(SuffixKV(stacked=stacked))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checks", [True, False])
def test_one_call_commit_equals_the_index_path(dtype, checks, monkeypatch):
    """dspec._C.commit_rows (stacked suffix K / V on the CPU) commits what the index path
    commits: keep index rows with -1 slots, ragged counts, growth past the capacity, the
    host path and the device path (value checks off); a bad index raises before a copy."""
    monkeypatch.setattr(dspec.config, "validate_values", checks)
    g = torch.Generator().manual_seed(7)
    a, b = KVCache(4, 3, 2, 8, dtype=dtype), KVCache(4, 3, 2, 8, dtype=dtype)
    for step in range(12):
        n = int(torch.randint(1, 9, (1,), generator=g))
        stacked = torch.randn(2, 4, 3, n, 2, 8, generator=g).to(dtype)
        if step % 3 == 0:
            keep = torch.randint(0, n + 1, (3,), generator=g)
            kw = dict(counts=keep)
        else:
            width = int(torch.randint(1, n + 1, (1,), generator=g))
            keep = torch.stack([torch.randperm(n, generator=g)[:width] for _ in range(3)])
            used = torch.randint(0, width + 1, (3,), generator=g)
            keep = torch.where(torch.arange(width)[None] < used[:, None], keep, -1)
            kw = dict(keep=keep)
        a.append(SuffixKV(stacked=stacked), **kw)
        b.append(SuffixKV(list(stacked[0].unbind(0)), list(stacked[1].unbind(0))), **kw)
    assert a.lengths.tolist() == b.lengths.tolist() and a.max_length > 16  # grown at least once
    for i in range(4):
        for x, y in zip(a.layer_rows(i), b.layer_rows(i)):
            assert torch.equal(x, y)
    ext = dspec._backend.extension()
    bad = torch.tensor([[0, 5]])
    lengths = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"keep\[0, 1\] = 5"):
        ext.commit_rows(
            a.k.data_ptr(),
            a.v.data_ptr(),
            a.k.data_ptr(),
            a.v.data_ptr(),
            1,
            0,
            0,
            1,
            2,
            4,
            bad.data_ptr(),
            2,
            lengths.data_ptr(),
            16,
            1,
        )
    good = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="capacity"):
        ext.commit_rows(
            a.k.data_ptr(),
            a.v.data_ptr(),
            a.k.data_ptr(),
            a.v.data_ptr(),
            1,
            0,
            0,
            1,
            2,
            1,
            good.data_ptr(),
            2,
            lengths.data_ptr(),
            16,
            1,
        )


def test_host_index_normalises_every_form():
    """KVCache.append's index (numpy, values checked): every keep / counts form gives the
    used suffix positions of each request in order, -1 after (no trailing all-unused column
    but keep's own), and bad ones raise the errors named in the message."""
    from dspec.models.kv_cache import host_keep_index

    def expect(rows, width):
        return [r + [-1] * (width - len(r)) for r in rows]

    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        batch, n = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        counts = torch.randint(0, n + 1, (batch,), generator=g)
        width = int(torch.randint(0, n + 1, (1,), generator=g))
        keep = torch.stack([torch.randperm(n, generator=g)[:width] for _ in range(batch)])
        used = torch.randint(0, width + 1, (batch,), generator=g)
        keep = torch.where(torch.arange(width)[None] < used[:, None], keep, -1)
        by_counts = expect([list(range(c)) for c in counts.tolist()], max(counts.tolist()))
        lists = [[i for i in row if i >= 0] for row in keep.tolist()]
        mask = torch.zeros(batch, n, dtype=torch.bool)
        for b, row in enumerate(lists):
            mask[b, row] = True
        cases = [
            (dict(counts=counts), by_counts),
            (dict(counts=counts.tolist()), by_counts),
            (dict(counts=int(counts[0])), expect([list(range(int(counts[0])))] * batch, int(counts[0]))),
            (dict(keep=keep), keep.tolist()),
            (dict(keep=keep[0]), [keep[0].tolist()] * batch),
            (dict(keep=lists), expect(lists, max(len(r) for r in lists))),
            (dict(keep=mask), expect([sorted(r) for r in lists], n)),
            (dict(keep=None), [list(range(n))] * batch),
        ]
        for kw, want in cases:
            assert host_keep_index(kw.get("keep"), kw.get("counts"), batch, n).tolist() == want, kw
    bad = [
        (dict(counts=[5, 0]), "counts must lie in"),
        (dict(counts=[1]), "one per request"),
        (dict(keep=torch.tensor([[0, 4], [0, 1]])), "keep indices must lie in"),
        (dict(keep=torch.tensor([[-1, 1], [0, 1]])), "must come after the used ones"),
        (dict(keep=torch.tensor([[1, 1], [0, 1]])), "same suffix index twice"),
        (dict(keep=[[1, 1], [0]]), "same suffix index twice"),
        (dict(keep=torch.tensor([[0], [1], [2]])), "keep indices must have shape"),
        (dict(keep=torch.tensor([[0], [1]]), counts=[1, 1]), "give keep or counts"),
        (dict(keep=torch.ones(2, 3, dtype=torch.bool)), "bool keep mask must have shape"),
        (dict(keep=[[1]]), "one sequence of indices per request"),
        (dict(keep="ab"), "keep must be None"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            host_keep_index(kw.get("keep"), kw.get("counts"), 2, 4)

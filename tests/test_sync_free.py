"""No host synchronisation in the speculative step: every op (value checks off, as in CUDA
graph capture) and the 'ar' decode step's hot part, counted with dspec.testing on CPU."""

import pytest
import torch

import dspec
from dspec import _backend
from dspec.decode.sampling import next_tokens
from dspec.models import load_checkpoint
from dspec.testing import assert_no_host_syncs, count_host_syncs
from tiny_checkpoints import write_checkpoint

B, L, V, N, HQ, HKV, D = 2, 3, 40, 4, 4, 2, 8
PARENTS = torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, 2]])


@pytest.fixture
def no_value_checks():
    saved = dspec.config.validate_values
    dspec.config.validate_values = False
    yield
    dspec.config.validate_values = saved


def _calls(backend):
    """(name, thunk, backend this op runs, or None when the op lacks it)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, L + 1, V, generator=g)
    conf = torch.rand(B, L, generator=g)
    drafts = torch.randint(0, V, (B, L), generator=g)
    tree_tokens = torch.randint(0, V, (B, N), generator=g)
    tree_logits = torch.randn(B, N, V, generator=g)
    q = torch.randn(B, N, HQ, D, generator=g)
    k, v = torch.randn(B, N, HKV, D, generator=g), torch.randn(B, N, HKV, D, generator=g)
    words = dspec.tree_mask(PARENTS).words
    pages = torch.randn(3, 4, HKV, D, generator=g)
    table = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    lse = torch.randn(B, N, HQ, generator=g)
    rng = torch.Generator().manual_seed(1)
    all4 = ("torch", "triton", "cuda", "cpp")
    calls = [
        ("token_stats", lambda b: dspec.token_stats(logits, backend=b), all4),
        ("topk_tokens", lambda b: dspec.topk_tokens(logits, 3, backend=b), ("torch", "triton")),
        ("mass_candidates", lambda b: dspec.mass_candidates(logits, 0.6, 4, backend=b), ("torch", "triton")),
        ("boundary_posterior", lambda b: dspec.boundary_posterior(conf, backend=b), ("torch", "triton")),
        ("rejection_boundaries", lambda b: dspec.rejection_boundaries(conf, 2, backend=b), ("torch", "triton")),
        ("expected_accept_length", lambda b: dspec.expected_accept_length(conf, backend=b), ("torch", "triton")),
        (
            "verify_chain greedy",
            lambda b: dspec.verify_chain(drafts, logits, num_drafts=torch.tensor([1, 3]), backend=b),
            all4,
        ),
        (
            "verify_chain sampled",
            lambda b: dspec.verify_chain(
                drafts, logits, draft_probs=torch.softmax(logits[:, :L], -1), temperature=0.7, generator=rng, backend=b
            ),
            all4,
        ),
        ("verify_tree greedy", lambda b: dspec.verify_tree(tree_tokens, PARENTS, tree_logits, backend=b), all4),
        (
            "verify_tree sampled",
            lambda b: dspec.verify_tree(tree_tokens, PARENTS, tree_logits, temperature=0.7, generator=rng, backend=b),
            all4,
        ),
        ("pack_mask", lambda b: dspec.pack_mask(torch.rand(3, 40, generator=g) > 0.5, backend=b), all4),
        ("unpack_mask", lambda b: dspec.unpack_mask(words, N, backend=b), all4),
        ("tree_mask", lambda b: dspec.tree_mask(PARENTS, backend=b), all4),
        (
            "cascade_attention suffix",
            lambda b: dspec.cascade_attention(q, k, v, words, return_lse=True, backend=b),
            ("torch", "triton"),
        ),
        (
            "cascade_attention paged",
            lambda b: dspec.cascade_attention(
                q,
                k,
                v,
                words,
                prefix_k=pages,
                prefix_v=pages,
                prefix_page_table=table,
                prefix_lens=lens,
                max_prefix_len=8,
                backend=b,
            ),
            ("triton",),
        ),
        (
            "cascade_attention ragged",
            lambda b: dspec.cascade_attention(
                q,
                k,
                v,
                words,
                prefix_k=pages[0],
                prefix_v=pages[1],
                prefix_indptr=torch.tensor([0, 1, 4]),
                max_prefix_len=3,
                backend=b,
            ),
            ("triton",),
        ),
        ("merge_states", lambda b: dspec.merge_states(q, lse, q.flip(1), lse.flip(0), backend=b), all4),
    ]
    return [(name, fn) for name, fn, provided in calls if backend in provided]


def _cpu_backends():
    out = ["torch"]
    if _backend.cpp_available():
        out.append("cpp")
    if _backend.triton_available() and _backend.triton_interpret():
        out.append("triton")
    return out


# The torch reference of verify_tree moves along the accepted path with boolean-mask
# indexing (``path[rows[move], depth[move]] = c``): a value-dependent shape per node.
# Engines run the cpp / cuda / triton kernels; the fix for the reference is in the report.
KNOWN_REFERENCE_SYNCS = {("torch", "verify_tree greedy"), ("torch", "verify_tree sampled")}


@pytest.mark.parametrize("backend", _cpu_backends())
def test_every_op_is_sync_free(backend, no_value_checks):
    for name, call in _calls(backend):
        if (backend, name) in KNOWN_REFERENCE_SYNCS:
            continue
        with assert_no_host_syncs(f"{name} ({backend})"):
            call(backend)


def test_known_reference_syncs_come_only_from_the_reference(no_value_checks):
    """The torch verify_tree and the torch cascade_attention with a prefix (a Python loop
    over requests reading prefix_indptr / prefix_lens) are the only ops with host reads."""
    calls = dict(_calls("torch"))
    q = torch.randn(1, 2, 2, 8)
    k = v = torch.randn(1, 2, 1, 8)
    with count_host_syncs() as syncs:
        for _, name in KNOWN_REFERENCE_SYNCS:
            calls[name]("torch")
        dspec.cascade_attention(
            q,
            k,
            v,
            prefix_k=torch.randn(3, 1, 8),
            prefix_v=torch.randn(3, 1, 8),
            prefix_indptr=torch.tensor([0, 3]),
            backend="torch",
        )
    assert all(e.where.startswith("dspec/reference/") for e in syncs), syncs.summary()


def test_value_checks_are_the_syncs_when_on():
    """With validate_values on (the default) the id / probability checks do read values."""
    conf = torch.rand(2, 3)
    with count_host_syncs() as syncs:
        dspec.boundary_posterior(conf, backend="torch")
    assert len(syncs) >= 1 and all("_validate" in e.where for e in syncs)


def test_counter_sees_the_usual_syncs():
    x = torch.arange(6.0)
    with count_host_syncs() as syncs:
        x.sum().item()
        bool((x > 2).any())
        x[x > 2]
        torch.nonzero(x)
        torch.unique(x)
    kinds = [e.kind for e in syncs]
    assert kinds.count("scalar_read") == 2 and "bool_index" in kinds and kinds.count("dynamic_shape") >= 2
    assert all("test_sync_free.py" in e.where for e in syncs)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_checkpoint(write_checkpoint(tmp_path_factory.mktemp("sync") / "llama", "llama", seed=5))


@pytest.mark.skipif(
    not (_backend.triton_available() and _backend.triton_interpret()),
    reason="the sync-free attention path is the Triton kernel (TRITON_INTERPRET on CPU)",
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ar_step_hot_part_is_sync_free(tiny_model, no_value_checks, temperature):
    """forward over a prepared plan (paged KV cache) + next-token choice + cache append,
    as a speculative step's commit passes it (device counts): no host read anywhere.
    Plan building is outside (it may take host lists)."""
    model = tiny_model
    cache = model.new_cache(2, capacity=32, layout="paged")
    prompts = [[5, 6, 7, 8], [9, 10]]
    plan = model.plan(prompts, cache)
    out = model(plan, logits="last", backend="triton")
    cache.append(out.suffix_kv, counts=plan.lengths)
    gen = torch.Generator().manual_seed(0)
    token = next_tokens(out.logits[:, -1], temperature, gen)
    history = [token]
    one = torch.ones(2, dtype=torch.int64)
    for _ in range(2):
        plan = model.plan(token[:, None], cache)
        with assert_no_host_syncs("the ar step"):
            out = model(plan, logits="last", backend="triton")
            token = next_tokens(out.logits[:, -1], temperature, gen)
            cache.append(out.suffix_kv, counts=one)
        history.append(token)
    assert cache.lengths.tolist() == [6, 4]  # the host learns the lengths afterwards
    # and the cache is exact: the same tokens as the reference path with a ragged cache
    ref_cache = model.new_cache(2, layout="ragged")
    ref_plan = model.plan(prompts, ref_cache)
    ref = model(ref_plan, logits="last", backend="torch")
    ref_cache.append(ref.suffix_kv, counts=ref_plan.lengths)
    gen = torch.Generator().manual_seed(0)
    ref_token = next_tokens(ref.logits[:, -1], temperature, gen)
    for step in range(1, 3):
        assert torch.equal(ref_token, history[step - 1])
        ref = model(model.plan(ref_token[:, None], ref_cache), logits="last", backend="torch")
        ref_cache.append(ref.suffix_kv, counts=[1, 1])
        ref_token = next_tokens(ref.logits[:, -1], temperature, gen)
    assert torch.equal(ref_token, history[2])


def _suffix_kv(batch=2, n=5, layers=2):
    from dspec.models import SuffixKV

    keys = [
        torch.arange(batch * n, dtype=torch.float32).view(batch, n, 1, 1).expand(batch, n, 1, 2) + 100 * layer
        for layer in range(layers)
    ]
    return SuffixKV([k.clone() for k in keys], [-k.clone() for k in keys])


@pytest.mark.parametrize(
    "keep",
    [
        torch.tensor([[0, 3, 4, -1], [0, 1, -1, -1]]),  # [0] + verify_tree path
        torch.tensor([[True, False, True, True, False], [False, True, True, False, True]]),
        torch.tensor([2, 0]),  # shared by the batch
    ],
)
def test_kv_cache_device_append_equals_host_append(keep, no_value_checks):
    """keep / counts as device tensors with value checks off: committed on the device with no
    host read, the same rows and lengths as the validated host path."""
    from dspec.models import KVCache

    kv = _suffix_kv()
    device_cache, host_cache = KVCache(2, 2, 1, 2, capacity=4), KVCache(2, 2, 1, 2, capacity=4)
    for _ in range(3):  # the third append outgrows capacity 16
        with assert_no_host_syncs("KVCache.append") if _ < 2 else count_host_syncs():
            added = device_cache.append(kv, keep)
            device_cache.append(kv, counts=torch.tensor([1, 3]))
        rows = keep.expand(2, -1).tolist()  # host path: per-request lists
        host_cache.append(
            kv,
            [[i for i, k in enumerate(r) if k] for r in rows]
            if keep.dtype == torch.bool
            else [[i for i in r if i >= 0] for r in rows],
        )
        host_cache.append(kv, counts=[1, 3])
    used = keep if keep.dtype == torch.bool else keep >= 0
    assert added.tolist() == used.expand(2, -1).sum(1).tolist()
    assert device_cache.lengths.tolist() == host_cache.lengths.tolist()
    for layer in range(2):
        for b in range(2):
            for got, want in zip(device_cache.get(layer, b), host_cache.get(layer, b)):
                assert torch.equal(got, want)
    prefix = device_cache.prefix(0) if device_cache.resolved_layout == "paged" else None
    assert prefix is None or prefix["max_prefix_len"] >= max(device_cache.lengths.tolist())

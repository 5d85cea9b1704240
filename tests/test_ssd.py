"""method "ssd": lossless self-speculative decoding against one-token-per-step diffusion."""

import pytest
import torch

import dspec
from dspec.decode.selfspec import chain_graph
from selfspec_cases import capture_caches, exact_first_block, sample_first_block, tiny, weak_context
from stats_cases import chi_square
from tiny_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    return tiny(tmp_path_factory, request.param, weights_hook=weak_context)


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16])
def test_greedy_equals_one_token_per_step(model, block_size):
    for prompt in ([5, 17, 42], [5, 17, 42, 9, 11, 3, 8, 2, 7]):
        ref = dspec.generate(model, prompt, method="diffusion", max_new_tokens=9, block_size=block_size)
        for mixed in (False, True):
            got = dspec.generate(
                model, prompt, method="ssd", max_new_tokens=9, block_size=block_size, mixed_order=mixed
            )
            assert got.tokens == ref.tokens, (block_size, prompt, mixed)
            # both commit a block inside a later forward and never forward the final block
            assert got.stats["nfe"]["target"] <= ref.stats["nfe"]["target"]


def test_batch_of_3_ragged_equals_singles_and_accepts_more_than_one(model):
    prompts = [[5, 17, 42, 9, 11], [7], [60, 2, 33, 4, 9, 9, 1]]
    kw = dict(max_new_tokens=10, block_size=4)
    ref = dspec.generate(model, prompts, method="diffusion", **kw)
    batch = dspec.generate(model, prompts, method="ssd", draft_len=3, **kw)
    singles = [dspec.generate(model, p, method="ssd", draft_len=3, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in ref]
    assert [g.tokens for g in singles] == [g.tokens for g in ref]
    stats = batch[0].stats
    assert stats["mean_accepted"] > 1.0
    assert max(stats["accepted_hist"]) > 1
    assert stats["nfe"]["target"] < ref[0].stats["nfe"]["target"]
    assert sum(stats["accepted_hist"].values()) >= 1 and stats["drafts"] >= stats["accepted_drafts"] > 0


def test_mixed_order_is_used_and_lossless(tmp_path_factory):
    plain = mixed = 0
    for family in ("sdar", "fast_dllm_v2"):
        m = tiny(tmp_path_factory, family)
        for prompt in ([5, 17, 42], [9, 4, 4, 12, 30]):
            ref = dspec.generate(m, prompt, method="diffusion", max_new_tokens=8, block_size=3)
            a = dspec.generate(m, prompt, method="ssd", max_new_tokens=8, block_size=3, draft_len=2, mixed_order=False)
            b = dspec.generate(m, prompt, method="ssd", max_new_tokens=8, block_size=3, draft_len=2, mixed_order=True)
            assert a.tokens == b.tokens == ref.tokens
            plain += a.stats["nfe"]["target"]
            mixed += b.stats["nfe"]["target"]
    assert mixed < plain  # some rounds took a swapped pair (c_k -> s_k -> c_{k+2})


def test_chain_graph_shape():
    g = chain_graph(3, mixed_order=True)
    assert g.nodes[0] == ((0, 0),)
    assert ((0, 0), (1, 0), (2, 0), (3, 0)) in g.nodes and ((0, 0), (2, 0)) in g.nodes
    parents = g.parents()
    c2 = g.nodes.index(((0, 0), (1, 0), (2, 0)))
    assert len(parents[c2]) == 2  # from c1 and from the swapped s0
    assert chain_graph(2).num_nodes == 3


def test_committed_kv_equals_one_step_run(model, monkeypatch):
    made = capture_caches(model, monkeypatch)
    prompt = [5, 17, 42, 9, 11]
    ref = dspec.generate(model, prompt, method="diffusion", max_new_tokens=8, block_size=4)
    ref_cache = made[-1]
    got = dspec.generate(model, prompt, method="ssd", max_new_tokens=8, block_size=4)
    cache = made[-1]
    assert got.tokens == ref.tokens
    # diffusion never commits its last block (nothing reads it); SSD does when a forward that
    # verified other steps completed it; every block before is in both
    n = int(ref_cache.lengths[0])
    assert int(cache.lengths[0]) in (n, n + 4) and n > 4
    for layer in range(model.config.num_layers):
        k, v = cache.get(layer, 0)
        rk, rv = ref_cache.get(layer, 0)
        torch.testing.assert_close(k[:n], rk[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:n], rv[:n], rtol=1e-5, atol=1e-5)


def test_sampling_matches_one_step_distribution(tmp_path_factory):
    m = tiny(tmp_path_factory, "sdar")
    prompt, temperature = [5, 17], 0.5
    exact = exact_first_block(m, prompt, temperature)
    counts, accepted = sample_first_block(m, prompt, 600, temperature, method="ssd")
    assert accepted > 0  # drafts were accepted under sampling
    assert chi_square(counts, exact).pvalue > 1e-3


def test_sampling_reproducible(model):
    kw = dict(method="ssd", max_new_tokens=6, block_size=2, temperature=0.8, seed=3)
    a = dspec.generate(model, [[5, 6], [7, 8, 9]], **kw)
    b = dspec.generate(model, [[5, 6], [7, 8, 9]], **kw)
    assert [g.tokens for g in a] == [g.tokens for g in b]


def test_eos_mid_block_matches_diffusion(model):
    from dspec.decode import diffusion, ssd

    prompts = [[5, 17, 42, 9, 11], [7], [60, 2, 33, 4, 9, 9, 1]]
    free, _ = diffusion.decode(model, prompts, max_new_tokens=10, block_size=4)
    eos = (free[0][5], free[2][2])  # tokens the greedy runs do produce, mid-block
    ref, _ = diffusion.decode(model, prompts, max_new_tokens=10, block_size=4, eos_ids=eos)
    got, _ = ssd.decode(model, prompts, max_new_tokens=10, block_size=4, eos_ids=eos)
    assert got == ref and any(len(r) < 10 for r in ref)


def test_bad_options(model, tmp_path):
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="draft_len"):
            dspec.generate(model, [1, 2], method="ssd", max_new_tokens=2, draft_len=bad)
    with pytest.raises(ValueError, match="mixed_order"):
        dspec.generate(model, [1, 2], method="ssd", max_new_tokens=2, mixed_order="yes")
    with pytest.raises(ValueError, match="block_size"):
        dspec.generate(model, [1, 2], method="ssd", max_new_tokens=2, block_size=0)
    with pytest.raises(ValueError, match="does not take"):
        dspec.generate(model, [1, 2], method="ssd", max_new_tokens=2, tokens_per_step=2)
    causal = dspec.load(write_checkpoint(tmp_path, "llama", seed=1))
    with pytest.raises(ValueError, match="masked-diffusion"):
        dspec.generate(causal, [1, 2], method="ssd", max_new_tokens=2)


@pytest.mark.parametrize(
    "block_size, draft_len, mixed, prune_to", [(2, 1, False, 4), (4, 3, True, 4), (8, 1, False, 2), (16, 1, False, 1)]
)
def test_cpu_defaults_keep_a_round_within_32_rows(model, block_size, draft_len, mixed, prune_to, monkeypatch):
    """On a CPU of the "tiles" cost class the default chain / pruned graph is capped so that
    the root, the drafts (with ssd's swapped states) and the next block's state fit 32 rows
    (two passes over every weight tile): ssd's draft_len the longest of min(block_size - 1, 4)
    that fits with mixed_order, spiffy's prune_to min(8, graph_size, 32 // block_size - 2);
    explicit values are kept."""
    from dspec.decode import cpu_cost
    from dspec.decode.cpu_cost import cpu_block_copies

    monkeypatch.setattr(cpu_cost, "cost_class", lambda model: "tiles")
    assert cpu_block_copies(model, block_size) == max(3, 32 // block_size)
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=block_size)
    assert (got.stats["draft_len"], got.stats["mixed_order"]) == (draft_len, mixed)
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=block_size, draft_len=3)
    assert got.stats["draft_len"] == 3 and got.stats["mixed_order"] == (block_size <= 4)
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=block_size, mixed_order=False)
    assert got.stats["mixed_order"] is False
    got = dspec.generate(model, [3, 4, 5], method="spiffy", max_new_tokens=4, block_size=block_size, graph_size=4)
    assert got.stats["prune_to"] == prune_to


@pytest.mark.parametrize("block_size, draft_len, prune_to", [(2, 4, 6), (4, 2, 2), (8, 1, 1)])
def test_cpu_defaults_without_amx_keep_16_rows_and_drop_the_swaps(model, block_size, draft_len, prune_to, monkeypatch):
    """On the "avx512" cost class (AVX-512 tiles, no AMX) a round carries 16 block rows per
    request, greedy or not, and ssd's default chain is the longest that fits without the
    swapped states; an explicit mixed_order is kept."""
    from dspec.decode import cpu_cost
    from dspec.decode.cpu_cost import cpu_block_copies

    monkeypatch.setattr(cpu_cost, "cost_class", lambda model: "avx512")
    assert cpu_block_copies(model, block_size) == cpu_block_copies(model, block_size, 2) == max(3, 16 // block_size)
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=block_size)
    assert (got.stats["draft_len"], got.stats["mixed_order"]) == (min(draft_len, block_size - 1), False)
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=block_size, mixed_order=True)
    assert got.stats["mixed_order"] == (got.stats["draft_len"] >= 2)
    got = dspec.generate(model, [3, 4, 5], method="spiffy", max_new_tokens=4, block_size=block_size, graph_size=8)
    assert got.stats["prune_to"] == prune_to


@pytest.mark.parametrize("block_size, draft_len, prune_to", [(2, 3, 6), (4, 1, 2), (8, 1, 1)])
def test_cpu_defaults_in_a_batch_or_sampling_keep_16_rows_a_request(
    model, block_size, draft_len, prune_to, monkeypatch
):
    """A batch's forward makes every row compute, and sampling accepts too little to pay for
    a second tile pass: the per-request budget drops to 16 rows (the "tiles" cost class)."""
    from dspec.decode import cpu_cost
    from dspec.decode.cpu_cost import cpu_block_copies

    monkeypatch.setattr(cpu_cost, "cost_class", lambda model: "tiles")
    assert cpu_block_copies(model, block_size, 2) == max(3, 16 // block_size)
    prompts = [[3, 4, 5], [7, 8]]
    got = dspec.generate(model, prompts, method="ssd", max_new_tokens=4, block_size=block_size)
    assert got[0].stats["draft_len"] == min(draft_len, block_size - 1)
    got = dspec.generate(model, prompts, method="spiffy", max_new_tokens=4, block_size=block_size, graph_size=8)
    assert got[0].stats["prune_to"] == prune_to
    sampled = dict(max_new_tokens=4, block_size=block_size, temperature=1.0, seed=0)
    assert cpu_block_copies(model, block_size, 1, 1.0) == max(3, 16 // block_size)
    got = dspec.generate(model, [3, 4, 5], method="ssd", **sampled)
    assert got.stats["draft_len"] == min(draft_len, block_size - 1)
    got = dspec.generate(model, [3, 4, 5], method="spiffy", graph_size=8, **sampled)
    assert got.stats["prune_to"] == prune_to


def test_default_chain_without_a_device_cap():
    from dspec.decode.ssd import chain_copies, default_chain

    assert default_chain(None, 4, None, None) == (3, True)
    assert default_chain(None, 16, None, None) == (4, True)
    assert default_chain(None, 16, 2, False) == (2, False)
    assert default_chain(8, 4, None, False) == (3, False) and chain_copies(3, False) == 5
    assert default_chain(3, 16, 3, None) == (3, False)  # explicit draft_len kept, swaps dropped
    assert default_chain(None, 1, None, None) == (1, False)


def test_cpu_defaults_on_the_avx2_class_keep_12_rows(model, monkeypatch):
    """On the "avx2" cost class every verified row is FMA work (``cpu_cost.FORWARD_COST``): a
    round carries ``CPU_AVX2_ROW_BUDGET`` rows (at least the root, one draft and the next
    block), greedy or not, and the row cost the pruning methods take is the measured slope."""
    from dspec.decode import cpu_cost

    monkeypatch.setattr(cpu_cost, "cost_class", lambda model: "avx2")
    for block_size in (2, 4, 8):
        want = max(3, cpu_cost.CPU_AVX2_ROW_BUDGET // block_size)
        assert cpu_cost.cpu_block_copies(model, block_size) == want
        assert cpu_cost.cpu_block_copies(model, block_size, 2, 1.0) == want
    table = cpu_cost.FORWARD_COST["avx2"]["float32"]
    assert cpu_cost.row_cost_of(model) == round((table[8] - 1) / 7, 3) > cpu_cost.CPU_ROW_COST
    assert cpu_cost.resolve_tree(model, "auto", 0.0) is None
    got = dspec.generate(model, [3, 4, 5], method="ssd", max_new_tokens=4, block_size=4)
    assert got.stats["draft_len"] >= 1

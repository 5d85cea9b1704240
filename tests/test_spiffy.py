"""method "spiffy": calibrated draft graphs, lossless against one-token-per-step diffusion."""

import json

import pytest
import torch

import dspec
from dspec.decode import spiffy_graph
from dspec.decode.selfspec import DraftGraph
from selfspec_cases import capture_caches, exact_first_block, sample_first_block, tiny, weak_context
from stats_cases import chi_square
from tiny_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    return tiny(tmp_path_factory, request.param, weights_hook=weak_context)


CAL_PROMPTS = [[5, 17, 42], [9, 4, 4, 12, 30], [60, 2, 33], [7, 7, 1, 50, 3, 8], [11, 22]]


@pytest.fixture(scope="module")
def graph4(model):
    return spiffy_graph.calibrate(model, CAL_PROMPTS, 4, 10, max_new_tokens=16, progress=False)


DIAMOND = DraftGraph(
    (
        ((0, 0),),
        ((0, 0), (1, 0)),
        ((0, 0), (2, 0)),
        ((0, 0), (1, 1)),
        ((0, 0), (1, 0), (2, 0)),
        ((0, 0), (1, 1), (2, 0)),
        ((0, 0), (1, 0), (2, 0), (3, 0)),
    )
)


def test_calibrated_graph_is_connected_and_round_trips(model, graph4, tmp_path):
    g = graph4
    assert g.block_size == 4 and 1 <= g.graph_size <= 10 and g.nodes[0] == ((0, 0),)
    assert g.graph.num_nodes == g.graph_size + 1
    parents = g.graph.parents()
    assert all(parents[n] for n in range(1, g.graph.num_nodes))  # connected to the root
    assert g.graph.counts[0] == max(g.graph.counts)  # every state visits the root
    path = spiffy_graph.save(g, tmp_path / "g.json")
    data = json.loads(path.read_text())
    assert data["format"] == "dspec-spiffy-graph" and data["meta"]["fingerprint"]
    back = spiffy_graph.load(path)
    assert back.nodes == g.nodes and back.graph.counts == g.graph.counts
    assert (back.block_size, back.graph_size) == (g.block_size, g.graph_size)


@pytest.mark.parametrize("block_size", [1, 2, 4, 7])
def test_greedy_equals_one_token_per_step(model, graph4, block_size):
    graph = graph4 if block_size == 4 else DIAMOND
    for prompt in ([5, 17, 42], [5, 17, 42, 9, 11, 3, 8, 2, 7]):
        ref = dspec.generate(model, prompt, method="diffusion", max_new_tokens=9, block_size=block_size)
        for prune_to in (1, 3, graph.graph.num_nodes - 1 if block_size == 4 else 6):
            got = dspec.generate(
                model, prompt, method="spiffy", max_new_tokens=9, block_size=block_size, graph=graph, prune_to=prune_to
            )
            assert got.tokens == ref.tokens, (block_size, prompt, prune_to)
            assert got.stats["nfe"]["target"] <= ref.stats["nfe"]["target"]  # see test_ssd


def test_batch_of_3_ragged_equals_singles_and_accepts_more_than_one(model, graph4):
    prompts = [[5, 17, 42, 9, 11], [7], [60, 2, 33, 4, 9, 9, 1]]
    kw = dict(max_new_tokens=12, block_size=4)
    ref = dspec.generate(model, prompts, method="diffusion", **kw)
    batch = dspec.generate(model, prompts, method="spiffy", graph=graph4, **kw)
    singles = [dspec.generate(model, p, method="spiffy", graph=graph4, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles] == [g.tokens for g in ref]
    assert batch[0].stats["mean_accepted"] > 1.0 and max(batch[0].stats["accepted_hist"]) > 1


def test_multi_parent_graph_reaches_shared_child(model):
    """The diamond's node {(0,0),(1,0),(2,0)} has two parents; whichever order the reference
    takes, the walk reaches it, and the output stays exact."""
    prompts = [[5, 17, 42], [9, 4, 4, 12, 30], [60, 2, 33, 4]]
    ref = dspec.generate(model, prompts, method="diffusion", max_new_tokens=12, block_size=4)
    got = dspec.generate(model, prompts, method="spiffy", max_new_tokens=12, block_size=4, graph=DIAMOND, prune_to=6)
    assert [g.tokens for g in got] == [g.tokens for g in ref]
    assert max(got[0].stats["accepted_hist"]) >= 3


def test_committed_kv_equals_one_step_run(model, graph4, monkeypatch):
    made = capture_caches(model, monkeypatch)
    prompt = [5, 17, 42, 9, 11]
    ref = dspec.generate(model, prompt, method="diffusion", max_new_tokens=11, block_size=4)
    ref_cache = made[-1]
    got = dspec.generate(model, prompt, method="spiffy", max_new_tokens=11, block_size=4, graph=graph4)
    cache = made[-1]
    assert got.tokens == ref.tokens and cache is not ref_cache
    # diffusion never commits its last block, Spiffy only with other steps (see test_ssd)
    n = int(ref_cache.lengths[0])
    assert int(cache.lengths[0]) in (n, n + 4) and n > 4
    for layer in range(model.config.num_layers):
        for mine, theirs in zip(cache.get(layer, 0), ref_cache.get(layer, 0)):
            torch.testing.assert_close(mine[:n], theirs[:n], rtol=1e-5, atol=1e-5)


def test_pruning_bounds_the_drafts(model, graph4):
    kw = dict(method="spiffy", max_new_tokens=10, block_size=4, graph=graph4)
    outs = {k: dspec.generate(model, [5, 17, 42, 9], prune_to=k, **kw) for k in (1, 2)}
    for k, g in outs.items():
        s = g.stats
        assert s["prune_to"] == k
        verify_rounds = sum(s["accepted_hist"].values())
        assert s["drafts"] <= k * verify_rounds
    assert outs[1].tokens == outs[2].tokens


def test_default_graph_calibrates_once_then_loads_from_cache(model, monkeypatch, tmp_path):
    kw = dict(method="spiffy", max_new_tokens=4, block_size=2, graph_size=3)
    calls = []
    real = spiffy_graph.calibrate

    def small_calibrate(m, prompts, block_size, graph_size, **opts):
        calls.append(block_size)
        return real(m, CAL_PROMPTS[:2], block_size, graph_size, max_new_tokens=8, progress=False)

    monkeypatch.setattr(spiffy_graph, "calibrate", small_calibrate)
    first = dspec.generate(model, [5, 17, 42], **kw)
    second = dspec.generate(model, [5, 17, 42], **kw)
    assert calls == [2] and first.tokens == second.tokens
    files = list(spiffy_graph.cache_dir().glob("*-bs2-D3.json"))
    assert len(files) == 1 and files[0].name.startswith(spiffy_graph.fingerprint(model))


def test_sampling_matches_one_step_distribution(tmp_path_factory):
    m = tiny(tmp_path_factory, "sdar")
    prompt, temperature = [5, 17], 0.5
    exact = exact_first_block(m, prompt, temperature)
    graph = DraftGraph((((0, 0),), ((0, 0), (1, 0)), ((0, 0), (1, 1)), ((0, 0), (1, 2))))
    counts, accepted = sample_first_block(m, prompt, 600, temperature, method="spiffy", graph=graph, prune_to=3)
    assert accepted > 0
    assert chi_square(counts, exact).pvalue > 1e-3


def test_bad_options_and_files(model, graph4, tmp_path):
    kw = dict(method="spiffy", max_new_tokens=2, block_size=4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prune_to"):
            dspec.generate(model, [1, 2], graph=graph4, prune_to=bad, **kw)
    with pytest.raises(ValueError, match="prune_to"):
        dspec.generate(model, [1, 2], graph=graph4, prune_to=graph4.graph_size + 1, **kw)
    for bad in (0, "8", False):
        with pytest.raises(ValueError, match="graph_size"):
            dspec.generate(model, [1, 2], graph_size=bad, **kw)
    with pytest.raises(ValueError, match="graph"):
        dspec.generate(model, [1, 2], graph=42, **kw)
    with pytest.raises(ValueError, match="no parent"):
        DraftGraph((((0, 0),), ((0, 0), (1, 0), (2, 0))))
    with pytest.raises(ValueError, match="root"):
        DraftGraph((((0, 0), (1, 0)),))
    (tmp_path / "x.json").write_text(json.dumps({"nodes": []}))
    with pytest.raises(ValueError, match="not a dspec Spiffy graph"):
        spiffy_graph.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="no Spiffy graph file"):
        spiffy_graph.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="graph_size"):
        spiffy_graph.calibrate(model, CAL_PROMPTS, 4, 0)
    causal = dspec.load(write_checkpoint(tmp_path / "llama", "llama", seed=1))
    with pytest.raises(ValueError, match="masked-diffusion"):
        dspec.generate(causal, [1, 2], method="spiffy", max_new_tokens=2)


def test_shipped_graphs_load_for_tiny_bd(monkeypatch):
    try:
        m = dspec.load("tiny-bd")
    except ValueError:
        pytest.skip("tiny-bd is not shipped in this checkout")
    if spiffy_graph.shipped_graph_path(m, m.block_size, 16) is None:
        pytest.skip("no graph shipped for tiny-bd's block size")

    def no_calibration(*a, **k):
        raise AssertionError("a shipped graph should be used, not a new calibration")

    shipped = spiffy_graph.load(spiffy_graph.shipped_graph_path(m, m.block_size, 16))
    if shipped.meta.get("fingerprint") != spiffy_graph.fingerprint(m):
        pytest.skip("tiny-bd's weights changed since its graphs were calibrated")
    monkeypatch.setattr(spiffy_graph, "calibrate", no_calibration)
    prompt = m.tokenizer.encode("Compute: 12 + 7 =")
    ref = dspec.generate(m, prompt, method="diffusion", max_new_tokens=16)
    got = dspec.generate(m, prompt, method="spiffy", max_new_tokens=16)
    assert got.tokens == ref.tokens
    assert got.stats["graph_size"] == shipped.graph_size


def test_fingerprint_is_kept_until_a_weight_changes(tmp_path_factory):
    """The weights' hash is computed once per model (it read every weight on every generate
    call) and recomputed after an in-place change or a replaced parameter."""
    import torch

    m = tiny(tmp_path_factory, "sdar")
    first = spiffy_graph.fingerprint(m)
    assert spiffy_graph.fingerprint(m) == first
    p = next(iter(m.parameters()))
    saved = p.detach().clone()
    with torch.no_grad():
        p.add_(1.0)  # in place: its version counter moves
    assert spiffy_graph.fingerprint(m) != first
    with torch.no_grad():
        p.copy_(saved)
    assert spiffy_graph.fingerprint(m) == first

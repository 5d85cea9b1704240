"""The self-speculative engine's compiled round (dspec._C.selfspec_*) against its torch
composition: the same state after every round, field by field, and the same outputs."""

import pytest
import torch

import dspec
from dspec import _backend
from dspec.decode.selfspec import DraftGraph, SelfSpecEngine, chain_graph
from selfspec_cases import tiny, weak_context
from tiny_checkpoints import write_checkpoint

ext = _backend.extension()
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(ext is None or not hasattr(ext, "selfspec_expand"), reason="dspec._C without the selfspec ops"),
]

# multi-parent, candidate ranks up to 2, depth 3
SPIFFY_LIKE = DraftGraph(
    (
        ((0, 0),),
        ((0, 0), (1, 0)),
        ((0, 0), (1, 1)),
        ((0, 0), (2, 0)),
        ((0, 0), (1, 0), (2, 0)),
        ((0, 0), (1, 2)),
        ((0, 0), (1, 0), (2, 1)),
        ((0, 0), (1, 1), (2, 0)),
        ((0, 0), (1, 0), (2, 0), (3, 0)),
    )
)
STATE = ("tokens", "masked", "known", "choice", "conf", "cand", "cand_logp", "carry")


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    return tiny(tmp_path_factory, request.param, weights_hook=weak_context)


def engines(model, prompts, graph, prune_to, block_size, max_new_tokens=12, num_candidates=1):
    kw = dict(
        graph=graph,
        prune_to=prune_to,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        generator=None,
        eos_ids=model.eos_token_ids,
        progress=None,
        block_size=block_size,
        trace=None,
        num_candidates=num_candidates,
    )
    native, torch_path = SelfSpecEngine(model, prompts, **kw), SelfSpecEngine(model, prompts, **kw)
    torch_path.native = None
    assert native.native is not None
    return native, torch_path


@pytest.mark.parametrize(
    "graph, prune_to, block_size",
    [
        (chain_graph(1), None, 1),
        (chain_graph(2), None, 4),
        (chain_graph(3, mixed_order=True), None, 4),
        (chain_graph(2), None, 5),
        (chain_graph(4), None, 16),
        (SPIFFY_LIKE, None, 4),
        (SPIFFY_LIKE, 2, 4),
        (SPIFFY_LIKE, 4, 8),
        (SPIFFY_LIKE, 1, 3),
        (SPIFFY_LIKE, 0, 4),
    ],
)
def test_every_round_equals_the_torch_composition(model, graph, prune_to, block_size):
    prompts = [[5, 17, 42, 9, 11], [7], [60, 2, 33, 4, 9, 9, 1]]
    a, b = engines(model, prompts, graph, prune_to, block_size, num_candidates=3)
    rounds = 0
    while True:
        more_a, more_b = a.round(), b.round()
        rounds += 1
        assert more_a == more_b and a.rows.tolist() == b.rows.tolist(), rounds
        for name in STATE:
            if more_a:
                assert torch.equal(getattr(a, name), getattr(b, name)), (name, rounds)
        assert a.forwards == b.forwards and a.suffix_tokens == b.suffix_tokens
        if not more_a:
            break
    assert a.generated == b.generated and a.stats() == b.stats()
    assert rounds > 3
    if block_size > 1 and prune_to != 0:
        assert a.st.accepted_drafts > 0


@pytest.mark.parametrize(
    "method, options",
    [("ssd", {}), ("ssd", {"mixed_order": True, "draft_len": 3}), ("spiffy", {"graph": SPIFFY_LIKE, "prune_to": 3})],
)
def test_generate_is_unchanged_and_lossless(model, method, options, monkeypatch):
    prompts = [[5, 17, 42, 9, 11], [7, 3], [60, 2, 33, 4, 9, 9, 1]]
    kw = dict(max_new_tokens=14, block_size=4)
    ref = dspec.generate(model, prompts, method="diffusion", **kw)
    got = dspec.generate(model, prompts, method=method, **kw, **options)
    monkeypatch.setattr(_backend, "extension", lambda: None)
    plain = dspec.generate(model, prompts, method=method, **kw, **options)
    assert [g.tokens for g in got] == [g.tokens for g in plain] == [g.tokens for g in ref]
    drop = ("wall_s", "tokens_per_s")
    assert [{k: v for k, v in g.stats.items() if k not in drop} for g in got] == [
        {k: v for k, v in g.stats.items() if k not in drop} for g in plain
    ]


def test_bfloat16_model_round_equals_torch_composition(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16_selfspec")
    m = dspec.load(
        write_checkpoint(path, "fast_dllm_v2", seed=5, vocab=64, weights_hook=weak_context), dtype=torch.bfloat16
    )
    a, b = engines(m, [[5, 17, 42], [9, 9, 1, 2, 3]], SPIFFY_LIKE, 3, 4, num_candidates=3)
    while True:
        more = a.round()
        assert b.round() == more
        if not more:
            break
        for name in STATE:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.generated == b.generated and a.stats() == b.stats()


# ------------------------------------------------------------------ the bindings' checks


def packed(graph):
    tab = graph.tables("cpu")
    return tab, (
        tab["packed"].data_ptr(),
        graph.num_nodes,
        graph.max_rank,
        graph.num_candidates,
        graph.depth,
        tab["num_parents"],
    )


def state(rows=1, bs=4, big_j=1):
    return dict(
        conf=torch.full((rows, bs), -1.0),
        masked=torch.ones(rows, bs, dtype=torch.bool),
        known=torch.zeros(rows, dtype=torch.bool),
        tokens=torch.full((rows, bs), 3, dtype=torch.int64),
        cand=torch.zeros(rows, bs, big_j, dtype=torch.int64),
        cand_logp=torch.zeros(rows, bs, big_j),
    )


def expand(graph_args, st, ws, nbytes, rows=1, bs=4, big_j=1, prune_to=-1, n_max=64):
    out = [torch.empty(rows * n_max, dtype=torch.int64) for _ in range(2)]
    words = torch.empty(rows * n_max * 2, dtype=torch.int32)
    lengths = torch.full((rows,), 8, dtype=torch.int64)
    return (
        ext.selfspec_expand(
            *graph_args,
            *(st[k].data_ptr() for k in ("conf", "masked", "known", "tokens", "cand", "cand_logp")),
            lengths.data_ptr(),
            rows,
            bs,
            big_j,
            prune_to,
            63,
            ws.data_ptr(),
            nbytes,
            out[0].data_ptr(),
            out[1].data_ptr(),
            words.data_ptr(),
        ),
        out,
        words,
    )


def test_expand_lays_out_the_root_copy_of_an_unknown_state():
    graph = chain_graph(2)
    _, g = packed(graph)
    nbytes = ext.selfspec_workspace_bytes(1, 4, graph.num_nodes, 1)
    ws = torch.zeros(nbytes, dtype=torch.uint8)
    (copies, need_next), (suffix, positions), words = expand(g, state(), ws, nbytes)
    assert (copies, need_next) == (1, False)  # an unknown state forwards itself alone
    assert suffix[:4].tolist() == [3, 3, 3, 3] and positions[:4].tolist() == [8, 9, 10, 11]
    assert words[:4].tolist() == [0b1111] * 4


def test_bad_arguments_raise_value_error_naming_them():
    graph = chain_graph(2)
    tab, g = packed(graph)
    nbytes = ext.selfspec_workspace_bytes(1, 4, graph.num_nodes, 1)
    ws = torch.zeros(nbytes, dtype=torch.uint8)
    st = state()
    with pytest.raises(ValueError, match="workspace_bytes"):
        expand(g, st, ws, nbytes - 8)
    with pytest.raises(ValueError, match="big_j"):
        expand(g, st, ws, nbytes, big_j=0)
    bad = tab["packed"].clone()
    bad[0] = 7  # assign: candidate rank past the graph's
    with pytest.raises(ValueError, match="assign"):
        expand((bad.data_ptr(),) + g[1:], st, ws, nbytes)
    nan = state()
    nan["conf"][0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        expand(g, nan, ws, nbytes)
    # score and advance only after expand, with expand's copies
    fresh = torch.zeros(nbytes, dtype=torch.uint8)
    logits, carry, logp = torch.zeros(4, 64), torch.zeros(1, 64), torch.empty(64)
    with pytest.raises(ValueError, match="must follow selfspec_expand"):
        ext.selfspec_score(
            fresh.data_ptr(),
            nbytes,
            1,
            4,
            graph.num_nodes,
            1,
            1,
            False,
            logits.data_ptr(),
            0,
            64,
            64,
            carry.data_ptr(),
            True,
            logp.data_ptr(),
        )
    (copies, need_next), _, _ = expand(g, st, ws, nbytes)
    with pytest.raises(ValueError, match="copies"):
        ext.selfspec_score(
            ws.data_ptr(),
            nbytes,
            1,
            4,
            graph.num_nodes,
            1,
            copies + 1,
            need_next,
            logits.data_ptr(),
            0,
            64,
            64,
            carry.data_ptr(),
            True,
            logp.data_ptr(),
        )
    with pytest.raises(ValueError, match="nodes / big_j / block_size"):
        ext.selfspec_score(
            ws.data_ptr(),
            nbytes,
            1,
            4,
            graph.num_nodes - 1,
            1,
            copies,
            need_next,
            logits.data_ptr(),
            0,
            64,
            64,
            carry.data_ptr(),
            True,
            logp.data_ptr(),
        )
    with pytest.raises(ValueError, match="dtype"):
        ext.selfspec_score(
            ws.data_ptr(),
            nbytes,
            1,
            4,
            graph.num_nodes,
            1,
            copies,
            need_next,
            logits.data_ptr(),
            5,
            64,
            64,
            carry.data_ptr(),
            True,
            logp.data_ptr(),
        )

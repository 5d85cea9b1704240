"""D2SD: branch construction, prefix-tree dedup, the union with DFlash's draft tree, greedy ==
ar (K in {1, 2, 4}, chain or tree first draft), batch == singles, the resample control,
lossless sampling.

The oracle-ish drafters of ``dflash_cases`` make acceptance non-trivial: the first drafter
is wrong (and less confident) at every ``wrong_every``-th position, the VP-drafter always
proposes the target's greedy path, so re-drafting at the right boundary recovers what the
first draft lost.
"""

from __future__ import annotations

import pytest
import torch

import dspec
from dflash_cases import (  # noqa: F401  (module fixtures)
    PROMPTS,
    OracleDrafter,
    ar_tokens,
    oracle_pair,
    peaked,
    restrict,
    second_token_marginal,
    target,
)
from dspec.decode import d2sd
from dspec.models.dflash import BlockDrafter
from stats_cases import chi_square

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def drafters(model, prompts, n, gamma, wrong_every=4):
    first = oracle_pair(model, prompts, n, block_size=gamma, wrong_every=wrong_every)
    vp = oracle_pair(model, prompts, n, kind="vp", block_size=gamma)
    return {"dflash": first, "vp": vp}


class FixedVP(BlockDrafter):
    """Every slot's favourite token is ``favourite``, the second favourite ``second``."""

    def __init__(self, target, gamma, favourite, second):
        base = BlockDrafter.for_target(target, kind="vp", block_size=gamma)
        super().__init__(base.config, target)
        self.favourite, self.second = favourite, second

    def forward(self, tokens, positions, cache, *, mask=None, backend=None, logits_from=0, draft_vocab=False):
        logits = torch.zeros(*tokens.shape, self.config.vocab_size)
        logits[..., self.favourite] = 5.0
        logits[..., self.second] = 4.0
        return restrict(self, logits, logits_from, draft_vocab)


def test_redraft_branches(target):
    gamma = 5
    vp = FixedVP(target, gamma, favourite=30, second=31)
    cache = vp.new_cache(1)
    first = torch.tensor([[30, 40, 30, 50]])
    lengths = torch.tensor([[0, 2, 3]])
    pos = torch.arange(gamma)[None]
    out = d2sd.redraft(vp, cache, torch.tensor([7]), first, lengths, pos, gamma)
    # branch k keeps first[:n_k]; slot n_k+1 never repeats the rejected first[n_k]
    assert out.tolist() == [[[31, 30, 30, 30], [30, 40, 31, 30], [30, 40, 30, 30]]]


def test_prefix_tree_dedup():
    tree = dspec.masks.d2sd_branches(9, [1, 2, 3], [1, 0], [[2, 4], [1, 2, 3]])
    # branches [1 2 3], [1 2 4], [1 2 3]: 1 and 2 shared, the third branch is the first
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2]
    assert tree.leaf_of_branch.tolist() == [3, 4, 3]


@pytest.mark.parametrize("tree", [None, "auto", 12])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_ar(target, k, tree):
    n, gamma = 20, 6
    ref = ar_tokens(target, PROMPTS, n)
    ds = drafters(target, PROMPTS, n, gamma)
    outs = [
        dspec.generate(
            target, p, method="d2sd", max_new_tokens=n, drafter=ds, k=k, tree=tree, row_cost=None, redraft_min=0
        )
        for p in PROMPTS
    ]
    assert [o.tokens for o in outs] == ref
    s = outs[0].stats
    from dspec.decode.cpu_cost import resolve_tree

    nodes = {None: None, "auto": resolve_tree(target, "auto", 0.0), 12: 12}[tree]  # "auto": this CPU's class
    assert s["k"] == k and s["branches"] == "vp" and s["draft_len"] == gamma - 1 and s["tree"] == nodes
    assert s["nfe"]["target"] == s["verify_forwards"] + 1
    assert s["nfe"]["drafter"] == s["nfe"]["vp_drafter"] == s["verify_forwards"]
    first_nodes = gamma - 1 if nodes is None else nodes
    assert 1 + min(first_nodes, gamma - 1) <= s["tree_nodes"] <= 1 + first_nodes + k * (gamma - 1)
    # the VP re-drafts fix the first draft's planted errors: more accepted than DFlash (its
    # tree: the same tree without the re-drafts)
    dfl = dspec.generate(
        target, PROMPTS[0], method="dflash", max_new_tokens=n, drafter=ds["dflash"], tree=nodes, row_cost=None
    )
    assert s["mean_accepted"] > dfl.stats["mean_accepted"]


@pytest.mark.parametrize("tree", [None, "auto"])
def test_redraft_gate(target, tree):
    """redraft_min gates the VP-drafter per request and cycle: output unchanged, fewer
    re-drafts as it rises, and at inf every cycle is DFlash's (same forwards, same tree)."""
    n, gamma = 20, 6
    ref = ar_tokens(target, PROMPTS, n)
    ds = drafters(target, PROMPTS, n, gamma)
    rates, vp_forwards = [], []
    for gate in (0, 0.2, 0.6, 0.95, float("inf")):
        outs = [
            dspec.generate(target, p, method="d2sd", max_new_tokens=n, drafter=ds, k=2, tree=tree, redraft_min=gate)
            for p in PROMPTS
        ]
        assert [o.tokens for o in outs] == ref, gate
        s = [o.stats for o in outs]
        assert all(x["redraft_min"] == (None if gate == float("inf") else gate) for x in s)  # None: never
        rates.append(sum(x["redraft_rate"] for x in s))
        vp_forwards.append(sum(x["nfe"]["vp_drafter"] for x in s))
        assert all(x["nfe"]["vp_drafter"] <= x["verify_forwards"] for x in s)
    assert rates[0] == len(PROMPTS) and rates[-1] == 0 and vp_forwards[-1] == 0
    assert 0 < vp_forwards[1] and sorted(rates, reverse=True) == rates
    # never re-drafting, a cycle is DFlash's: the same verification forwards and acceptance
    # (d2sd drafts every cycle: DFlash's target-only fallback off)
    for p, o in zip(PROMPTS, outs):
        dfl = dspec.generate(
            target, p, method="dflash", max_new_tokens=n, drafter=ds["dflash"], tree=tree, ar_fallback=False
        )
        assert dfl.stats["nfe"]["target"] == o.stats["nfe"]["target"]
        assert dfl.stats["mean_accepted"] == o.stats["mean_accepted"]


def test_gated_off_cycles_are_dflash_cycles_when_sampling(peaked):
    """At T = 1 a cycle nobody re-drafts is DFlash's chain cycle (verified against q): with
    the gate shut the output equals ``dflash``'s token for token, same seed (``dflash``
    drafting every cycle: d2sd has no ``ar_fallback``)."""
    prompt = [5, 6, 7]
    ds = drafters(peaked, [prompt], 12, 4, wrong_every=3)
    kw = dict(max_new_tokens=12, temperature=1.0, seed=3)
    d2 = dspec.generate(peaked, [prompt] * 6, method="d2sd", drafter=ds, k=2, redraft_min=float("inf"), **kw)
    df = dspec.generate(peaked, [prompt] * 6, method="dflash", drafter=ds["dflash"], ar_fallback=False, **kw)
    assert [o.tokens for o in d2] == [o.tokens for o in df]
    assert d2[0].stats["nfe"]["vp_drafter"] == 0 and d2[0].stats["mean_accepted"] == df[0].stats["mean_accepted"]


def test_redraft_gate_in_a_batch(target):
    """A batch whose requests pass the gate in different cycles equals its requests alone."""
    n, gamma = 16, 6
    ds = drafters(target, PROMPTS, n, gamma)
    batch = dspec.generate(target, PROMPTS, method="d2sd", max_new_tokens=n, drafter=ds, k=2, redraft_min=0.8)
    assert [o.tokens for o in batch] == ar_tokens(target, PROMPTS, n)
    assert 0 < batch[0].stats["redraft_rate"] < 1


def test_redraft_gate_options(target):
    from dspec.decode.cpu_cost import CPU_REDRAFT_MIN, resolve_redraft_min

    ds = drafters(target, PROMPTS[:1], 4, 4)
    assert resolve_redraft_min(target, "auto", redrafts=True) == CPU_REDRAFT_MIN
    assert resolve_redraft_min(target, "auto", redrafts=False) == 0.0
    out = dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds)
    assert out.stats["redraft_min"] == (None if CPU_REDRAFT_MIN == float("inf") else CPU_REDRAFT_MIN)
    for bad in (-0.1, float("nan"), True, "sometimes", None):
        with pytest.raises(ValueError, match="redraft_min"):
            dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, redraft_min=bad)
    with pytest.raises(ValueError, match="redraft_min"):
        dspec.generate(
            target,
            PROMPTS[0],
            method="d2sd",
            max_new_tokens=4,
            drafter=ds["dflash"],
            branches="resample",
            redraft_min=0.5,
        )


def _paths(tokens, parents):
    """Every node's token path from the root (root excluded), one request's tree."""
    paths = []
    for j in range(len(tokens)):
        path, u = [], j
        while u > 0:
            path.append(int(tokens[u]))
            u = int(parents[u])
        paths.append(tuple(reversed(path)))
    return paths


def test_union_tree_holds_the_draft_tree_and_every_branch():
    """d2sd's tree with ``tree``: DFlash's draft tree unchanged (its columns first), each
    re-drafted branch and the lookup chain as paths, no two siblings with one token."""
    from dspec.decode.dflash import draft_tree

    gen = torch.Generator().manual_seed(3)
    batch, slots, top, k = 5, 6, 3, 2
    probs = torch.rand(batch, slots, top, generator=gen).sort(-1, descending=True).values
    tokens = torch.rand(batch, slots, 9, generator=gen).argsort(-1)[..., :top]  # distinct per slot
    roots, root_pos = torch.full((batch,), 50), torch.full((batch,), 10)
    first = tuple(t.numpy() for t in draft_tree(probs, tokens, 8, roots, root_pos)[:3])
    branch_tokens = torch.randint(0, 9, (batch, k, slots), generator=gen)
    branch_tokens[:, 0, :2] = tokens[:, :2, 0]  # branch 0 shares the best path's start
    branch_len = torch.randint(0, slots + 1, (batch, k), generator=gen)
    chain = torch.randint(0, 9, (batch, 4), generator=gen).numpy()
    counts = torch.randint(0, 5, (batch,), generator=gen).numpy()
    tok, par, pos = d2sd.union_tree(first, branch_tokens, branch_len, chain, counts)
    width = first[0].shape[1]
    assert (tok[:, :width] == first[0]).all() and (par[:, :width] == first[1]).all()
    for b in range(batch):
        live = [0] + [j for j in range(1, tok.shape[1]) if par[b, j] >= 0]
        paths = _paths(tok[b], par[b])
        have = {paths[j] for j in live}
        assert len(have) == len(live)  # siblings never repeat a token
        assert all(pos[b, j] == 10 + len(paths[j]) for j in live)
        wanted = [tuple(branch_tokens[b, j, : branch_len[b, j]].tolist()) for j in range(k)]
        wanted.append(tuple(chain[b, : counts[b]].tolist()))
        for path in wanted:
            assert all(path[:d] in have for d in range(len(path) + 1))
        old = {paths[j] for j in range(width) if j == 0 or first[1][b, j] >= 0}
        assert have == old | {p[:d] for p in wanted for d in range(len(p) + 1)}


@pytest.mark.parametrize("branches", ["vp", "resample"])
def test_draft_vocabs_keep_greedy_equal_to_ar(target, branches):
    """Both drafters restricted to draft vocabularies (the VP's without the rejected
    first drafts' ids some of the time): branches still verify to ar's tokens."""
    n, gamma = 16, 5
    ds = drafters(target, PROMPTS, n, gamma)
    v = target.config.vocab_size
    ds["dflash"].set_draft_vocab(torch.arange(0, v, 2))
    ds["vp"].set_draft_vocab(torch.arange(0, v, 3))
    drafter = ds if branches == "vp" else ds["dflash"]
    outs = [
        dspec.generate(
            target, p, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=drafter, k=2, branches=branches
        )
        for p in PROMPTS
    ]
    assert [o.tokens for o in outs] == ar_tokens(target, PROMPTS, n)


@pytest.mark.parametrize("pool,weight", [(4, 0.0), (2, 1.0), (4, 0.5)])
@pytest.mark.parametrize("tree", [None, "auto"])
def test_boundary_pool_and_prior_keep_greedy_equal_to_ar(target, pool, weight, tree):
    """Re-drafting at more boundaries than kept and mixing the first drafter's opinion into
    the first re-drafted slot (over different draft vocabularies) change only which
    branches are verified."""
    n, gamma = 16, 6
    ds = drafters(target, PROMPTS, n, gamma)
    v = target.config.vocab_size
    ds["dflash"].set_draft_vocab(torch.arange(0, v, 2))
    ds["vp"].set_draft_vocab(torch.arange(0, v, 3))
    outs = [
        dspec.generate(
            target,
            p,
            method="d2sd",
            redraft_min=0,
            max_new_tokens=n,
            drafter=ds,
            k=2,
            tree=tree,
            boundary_pool=pool,
            prior_weight=weight,
            row_cost=None,
        )
        for p in PROMPTS
    ]
    assert [o.tokens for o in outs] == ar_tokens(target, PROMPTS, n)
    s = outs[0].stats
    assert s["boundary_pool"] == pool and s["prior_weight"] == weight and s["k"] == 2


def test_prior_weight_default(target):
    ds = drafters(target, PROMPTS[:1], 4, 4)
    vp = dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, redraft_min=0)
    control = dspec.generate(
        target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds["dflash"], branches="resample"
    )
    assert vp.stats["prior_weight"] == d2sd.PRIOR_WEIGHT and control.stats["prior_weight"] == 0.0
    assert vp.stats["boundary_pool"] == vp.stats["k"]


def test_vocab_map_and_first_prior():
    cols = d2sd.vocab_map(torch.tensor([5, 2, 9]), torch.tensor([2, 7, 9]), 10)
    assert cols.tolist() == [1, -1, 2]
    assert d2sd.vocab_map(None, torch.tensor([3, 4]), 10).tolist() == [3, 4]
    assert d2sd.vocab_map(torch.tensor([4, 3]), None, 5).tolist() == [-1, -1, -1, 1, 0]
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    logp = logits.log_softmax(-1)
    prior = d2sd.first_prior(logits, cols, 0.5)
    assert torch.allclose(prior, 0.5 * torch.stack([logp[..., 1], logp[..., 0], logp[..., 2]], -1))


def test_random_drafters_equal_ar(target):
    n = 12
    first = BlockDrafter.for_target(target, block_size=4, seed=1)
    vp = BlockDrafter.for_target(target, kind="vp", block_size=4, seed=2)
    got = [
        dspec.generate(
            target, p, method="d2sd", redraft_min=0, max_new_tokens=n, drafter={"dflash": first, "vp": vp}, k=3
        )
        for p in PROMPTS
    ]
    assert [g.tokens for g in got] == ar_tokens(target, PROMPTS, n)


def test_resample_control_equals_ar(target):
    n, gamma = 16, 5
    ds = drafters(target, PROMPTS, n, gamma)
    outs = dspec.generate(
        target, PROMPTS, method="d2sd", max_new_tokens=n, drafter=ds["dflash"], k=2, branches="resample"
    )
    assert [o.tokens for o in outs] == ar_tokens(target, PROMPTS, n)
    s = outs[0].stats
    assert "vp_drafter" not in s["nfe"] and s["branches"] == "resample"


def test_batch_equals_singles(target):
    n, gamma = 16, 5
    ds = drafters(target, PROMPTS, n, gamma, wrong_every=3)
    singles = [
        dspec.generate(target, p, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2) for p in PROMPTS
    ]
    batch = dspec.generate(target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2)
    assert [g.tokens for g in batch] == [g.tokens for g in singles] == ar_tokens(target, PROMPTS, n)
    assert batch[0].stats["cycles"] == sum(g.stats["cycles"] for g in singles)


def test_bad_options(target):
    ds = drafters(target, PROMPTS[:1], 4, 4)
    with pytest.raises(ValueError, match="k must"):
        dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, k=4)
    with pytest.raises(ValueError, match="branches"):
        dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, branches="tree")
    for bad in (0, -2, True, "big", 2.5):
        with pytest.raises(ValueError, match="tree"):
            dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, tree=bad)
    for bad in (1, 5, True, 2.0):
        with pytest.raises(ValueError, match="boundary_pool"):
            dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, k=2, boundary_pool=bad)
    for bad in (-0.1, True, "x", float("nan")):
        with pytest.raises(ValueError, match="prior_weight"):
            dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter=ds, prior_weight=bad)
    with pytest.raises(ValueError, match="branches='vp'"):
        dspec.generate(
            target,
            PROMPTS[0],
            method="d2sd",
            max_new_tokens=4,
            drafter=ds["dflash"],
            branches="resample",
            prior_weight=1.0,
        )
    with pytest.raises(ValueError, match="keys"):
        dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter={"first": ds["dflash"]})
    with pytest.raises(ValueError, match="'vp'"):
        # a DFlash drafter where the VP-drafter belongs
        dspec.generate(
            target, PROMPTS[0], method="d2sd", max_new_tokens=4, drafter={"dflash": ds["dflash"], "vp": ds["dflash"]}
        )


@pytest.mark.parametrize(
    "branches,tree,gate,shape",
    [
        ("vp", "auto", "auto", {}),
        ("vp", "auto", 0, {}),
        ("resample", "auto", "auto", {}),
        ("vp", 6, 0.4, {}),
        ("vp", None, 0, {"boundary_pool": 3, "prior_weight": 1.0}),
    ],
)
def test_sampling_preserves_target_distribution(peaked, branches, tree, gate, shape):
    prompt = [5, 6, 7]
    probs = second_token_marginal(peaked, prompt, 1.0)
    ds = drafters(peaked, [prompt], 6, 4, wrong_every=3)
    drafter = ds if branches == "vp" else ds["dflash"]
    out = dspec.generate(
        peaked,
        [prompt] * 1500,
        method="d2sd",
        max_new_tokens=3,
        drafter=drafter,
        temperature=1.0,
        seed=0,
        k=2,
        branches=branches,
        tree=tree,
        redraft_min=gate,
        **shape,
    )
    assert out[0].stats["tree"] == (None if tree == "auto" else tree)  # "auto" at T > 0: the chain
    counts = torch.bincount(torch.tensor([g.tokens[1] for g in out]), minlength=peaked.config.vocab_size)
    fit = chi_square(counts, probs)
    assert fit.fits, fit
    assert out[0].stats["mean_accepted"] > 1.0


def test_shipped_tiny_ar_drafters():
    from dflash_cases import SHIPPED_PROMPTS, shipped_tiny_ar

    model = shipped_tiny_ar()
    ref = [g.tokens for g in dspec.generate(model, SHIPPED_PROMPTS, method="ar", max_new_tokens=24)]
    out = dspec.generate(model, SHIPPED_PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=24, k=2)
    assert [g.tokens for g in out] == ref
    assert out[0].stats["mean_accepted"] > 1.2


def _reach_bruteforce(c, r, n):
    """Every node of one request's tree with its reach probability, by the formula."""
    nodes = {("first", j): float(torch.tensor(c[: j + 1], dtype=torch.float64).prod()) for j in range(len(c))}
    for k, nk in enumerate(n):
        p = (float(torch.tensor(c[:nk], dtype=torch.float64).prod()) if nk else 1.0) * (1.0 - c[nk])
        for j in range(nk, len(c)):
            p *= r[k][j]
            nodes[(k, j)] = p
    return nodes


@pytest.mark.parametrize("row_cost", [0.0, 0.05, 0.3, 2.0])
def test_prune_tree_keeps_the_best_subtree(row_cost):
    gen = torch.Generator().manual_seed(int(row_cost * 100))
    batch, k, slots = 6, 3, 7
    c = torch.rand(batch, slots, generator=gen) ** 0.5
    r = torch.rand(batch, k, slots, generator=gen)
    n = torch.stack([torch.randperm(slots, generator=gen)[:k] for _ in range(batch)])
    first_keep, branch_keep = d2sd.prune_tree(c, r, n, row_cost)
    for b in range(batch):
        nodes = _reach_bruteforce(c[b].tolist(), r[b].tolist(), n[b].tolist())
        ordered = sorted(nodes.values(), reverse=True)
        gains = [(1 + sum(ordered[:m])) / (1 + row_cost * m) for m in range(1, len(ordered) + 1)]
        best = max(range(len(gains)), key=gains.__getitem__)
        kept = {key for key, p in nodes.items() if p >= ordered[best]}
        assert int(first_keep[b]) == sum(1 for key in kept if key[0] == "first")
        for j in range(k):
            mine = sorted(s for key, s in ((key, key[1]) for key in kept) if key[0] == j)
            assert int(branch_keep[b, j]) == len(mine)
            assert mine == list(range(int(n[b, j]), int(n[b, j]) + len(mine)))  # a prefix of the branch
            if mine and int(n[b, j]):
                assert int(first_keep[b]) >= int(n[b, j])  # its parent is kept
    if row_cost == 0.0:  # free rows: every node is worth verifying
        assert (first_keep == slots).all() and (branch_keep == slots - n).all()


@pytest.mark.parametrize("row_cost", [0.0, 0.1, 0.5, 5.0])
def test_adaptive_tree_equals_ar(target, row_cost):
    n, gamma = 20, 6
    ds = drafters(target, PROMPTS, n, gamma)
    outs = dspec.generate(
        target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2, row_cost=row_cost
    )
    assert [o.tokens for o in outs] == ar_tokens(target, PROMPTS, n)
    full = dspec.generate(
        target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2, row_cost=None
    )
    assert outs[0].stats["tree_nodes"] <= full[0].stats["tree_nodes"]
    if row_cost >= 5.0:  # costly rows: a node or two per cycle
        assert outs[0].stats["tree_nodes"] <= 3.0
    with pytest.raises(ValueError, match="row_cost"):
        dspec.generate(target, PROMPTS[0], method="d2sd", redraft_min=0, max_new_tokens=2, drafter=ds, row_cost=-0.1)
    with pytest.raises(ValueError, match="row_cost"):
        dspec.generate(
            target, PROMPTS[0], method="d2sd", max_new_tokens=2, drafter=ds["dflash"], branches="resample", row_cost=0.1
        )


def test_cpu_default_row_cost_is_measured_constant(target):
    """row_cost="auto" (the default) prunes at the measured row cost of the CPU's class
    (cpu_cost.row_cost_of: CPU_ROW_COST on the AMX and AVX-512 tiles) -- the tree of that explicit value --
    and falls back to the full tree for "resample" branches; dflash's default is the same
    adaptive length."""
    from dspec.decode.cpu_cost import CPU_ROW_COST, cost_class, resolve_row_cost, row_cost_of

    n, gamma = 12, 6
    ds = drafters(target, PROMPTS, n, gamma)
    auto = dspec.generate(target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2)
    fixed = dspec.generate(
        target, PROMPTS, method="d2sd", redraft_min=0, max_new_tokens=n, drafter=ds, k=2, row_cost=row_cost_of(target)
    )
    assert [o.tokens for o in auto] == [o.tokens for o in fixed] == ar_tokens(target, PROMPTS, n)
    assert auto[0].stats["tree_nodes"] == fixed[0].stats["tree_nodes"]
    dspec.generate(target, PROMPTS[0], method="d2sd", max_new_tokens=2, drafter=ds["dflash"], branches="resample")
    assert resolve_row_cost(target, "auto") == row_cost_of(target) and resolve_row_cost(target, None) is None
    assert (row_cost_of(target) == CPU_ROW_COST) == (cost_class(target) != "avx2")
    with pytest.raises(ValueError, match="row_cost"):
        resolve_row_cost(target, "fast")


def test_adaptive_tree_sampling_preserves_target_distribution(peaked):
    prompt = [5, 6, 7]
    probs = second_token_marginal(peaked, prompt, 1.0)
    ds = drafters(peaked, [prompt], 6, 4, wrong_every=3)
    out = dspec.generate(
        peaked,
        [prompt] * 1500,
        method="d2sd",
        redraft_min=0,
        max_new_tokens=3,
        drafter=ds,
        temperature=1.0,
        seed=0,
        k=2,
        row_cost=0.3,
    )
    counts = torch.bincount(torch.tensor([g.tokens[1] for g in out]), minlength=peaked.config.vocab_size)
    fit = chi_square(counts, probs)
    assert fit.fits, fit

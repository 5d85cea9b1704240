"""dspec.masks: every builder's dense mask against an explicitly written expectation, its
positions, prefix_tree / d2sd_branches round trips, and verify_tree on a prefix tree."""

import random

import pytest
import torch

import dspec
import dspec.masks as M
from dspec.reference.pack_mask import pack_mask as ref_pack


def grid(text: str) -> torch.Tensor:
    """Rows of 'x' (attend) and '.' (not), whitespace separated."""
    rows = [line.split() for line in text.strip().splitlines()]
    return torch.tensor([[c == "x" for c in row] for row in rows])


def check(sm: M.SuffixMask, dense: torch.Tensor, positions):
    n = dense.shape[-1]
    assert isinstance(sm, M.SuffixMask)
    assert sm.words.dtype == torch.int32 and sm.words.shape == (*dense.shape[:-1], (n + 31) // 32)
    assert sm.positions.dtype == torch.int64
    assert torch.equal(sm.words, ref_pack(dense))
    assert torch.equal(sm.dense(), dense)
    assert sm.positions.tolist() == list(positions)
    assert sm.num_tokens == n


def test_causal():
    check(
        M.causal(4),
        grid("""
        x . . .
        x x . .
        x x x .
        x x x x
    """),
        [0, 1, 2, 3],
    )
    check(M.causal(1), grid("x"), [0])
    check(M.causal(40), torch.ones(40, 40, dtype=torch.bool).tril(), range(40))


def test_block_diffusion():
    check(
        M.block_diffusion(3),
        grid("""
        x x x
        x x x
        x x x
    """),
        [0, 1, 2],
    )
    check(M.block_diffusion(33), torch.ones(33, 33, dtype=torch.bool), range(33))


def test_ssd_copies():
    check(
        M.ssd_copies(2, 3),
        grid("""
        x x . . . .
        x x . . . .
        . . x x . .
        . . x x . .
        . . . . x x
        . . . . x x
    """),
        [0, 1, 0, 1, 0, 1],
    )
    check(M.ssd_copies(3, 1), grid("x x x\nx x x\nx x x"), [0, 1, 2])
    bs, c = 17, 3  # copies straddle word boundaries
    dense = torch.zeros(bs * c, bs * c, dtype=torch.bool)
    for i in range(c):
        dense[i * bs : (i + 1) * bs, i * bs : (i + 1) * bs] = True
    check(M.ssd_copies(bs, c), dense, list(range(bs)) * c)


def test_s2d2_two_l():
    check(
        M.s2d2_two_l(3),
        grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        . . . x . .
        x . . . x .
        x x . . . x
    """),
        [0, 1, 2, 0, 1, 2],
    )
    check(M.s2d2_two_l(1), grid("x .\n. x"), [0, 0])
    span = 20
    dense = torch.zeros(2 * span, 2 * span, dtype=torch.bool)
    for i in range(span):
        dense[i, : i + 1] = True
        dense[span + i, :i] = True
        dense[span + i, span + i] = True
    check(M.s2d2_two_l(span), dense, list(range(span)) * 2)


def test_spiffy_draft_graph():
    # one real block, two drafts of it: each draft sees only itself
    check(
        M.spiffy_draft_graph(2, [0, 0]),
        grid("""
        x x . . . .
        x x . . . .
        . . x x . .
        . . x x . .
        . . . . x x
        . . . . x x
    """),
        [0, 1, 0, 1, 0, 1],
    )
    # two real blocks (block-causal), two drafts of block 1
    check(
        M.spiffy_draft_graph(2, [1, 1], num_real_blocks=2),
        grid("""
        x x . . . . . .
        x x . . . . . .
        x x x x . . . .
        x x x x . . . .
        x x . . x x . .
        x x . . x x . .
        x x . . . . x x
        x x . . . . x x
    """),
        [0, 1, 2, 3, 2, 3, 2, 3],
    )
    # block-causal: a draft of block 0 sees no real block
    check(
        M.spiffy_draft_graph(1, [0, 2], num_real_blocks=3),
        grid("""
        x . . . .
        x x . . .
        x x x . .
        . . . x .
        x x . . x
    """),
        [0, 1, 2, 0, 2],
    )
    # fully visible real blocks: every real block but the replaced one
    check(
        M.spiffy_draft_graph(2, [0, 1], 2, False),
        grid("""
        x x x x . . . .
        x x x x . . . .
        x x x x . . . .
        x x x x . . . .
        . . x x x x . .
        . . x x x x . .
        x x . . . . x x
        x x . . . . x x
    """),
        [0, 1, 2, 3, 0, 1, 2, 3],
    )
    check(M.spiffy_draft_graph(3, []), torch.ones(3, 3, dtype=torch.bool), [0, 1, 2])
    # a tensor of replaces, larger blocks
    sm = M.spiffy_draft_graph(20, torch.tensor([0, 1, 0]), num_real_blocks=2)
    d = sm.dense()
    assert d.shape == (100, 100)
    assert d[40:60, 40:60].all() and not d[40:60, 0:20].any() and not d[40:60, 60:].any()
    assert d[60:80, 0:20].all() and not d[60:80, 20:60].any() and not d[60:80, 80:].any()
    assert sm.positions[40:60].tolist() == list(range(20))
    assert sm.positions[60:80].tolist() == list(range(20, 40))


def test_tree_builder():
    check(
        M.tree([-1, 0, 1, 0, 3]),
        grid("""
        x . . . .
        x x . . .
        x x x . .
        x . . x .
        x . . x x
    """),
        [0, 1, 2, 1, 2],
    )
    batched = M.tree(torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32))
    assert batched.words.shape == (2, 3, 1)
    assert batched.dense().tolist() == [grid("x . .\nx x .\nx x x").tolist(), grid("x . .\nx x .\nx . x").tolist()]
    assert batched.positions.tolist() == [[0, 1, 2], [0, 1, 1]]
    with pytest.raises(ValueError, match="padding"):
        M.tree([-1, -1, 1])
    with pytest.raises(ValueError, match="parents"):
        M.tree([[[-1]]])


def test_device_argument():
    sm = M.causal(3, device="cpu")
    assert sm.words.device.type == "cpu"
    with pytest.raises(ValueError, match="device"):
        M.causal(3, device="no-such-device")
    if torch.cuda.is_available():
        sm = M.s2d2_two_l(4, device="cuda")
        assert sm.words.is_cuda and sm.positions.is_cuda
        assert torch.equal(sm.words.cpu(), M.s2d2_two_l(4).words)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: M.causal(0), "n must be >= 1"),
        (lambda: M.causal(2.0), "n must be an int"),
        (lambda: M.causal(True), "n must be an int"),
        (lambda: M.block_diffusion(-1), "block_size"),
        (lambda: M.ssd_copies(4, 0), "num_copies"),
        (lambda: M.ssd_copies("4", 2), "block_size"),
        (lambda: M.s2d2_two_l(0), "span"),
        (lambda: M.spiffy_draft_graph(0, [0]), "block_size"),
        (lambda: M.spiffy_draft_graph(2, [1]), r"replaces\[0\]"),
        (lambda: M.spiffy_draft_graph(2, [0, -1]), r"replaces\[1\]"),
        (lambda: M.spiffy_draft_graph(2, [0], num_real_blocks=0), "num_real_blocks"),
        (lambda: M.spiffy_draft_graph(2, 0), "replaces"),
        (lambda: M.spiffy_draft_graph(2, [0.5]), r"replaces\[0\]"),
        (lambda: M.spiffy_draft_graph(2, [0], 1, "yes"), "block_causal"),
        (lambda: M.prefix_tree([[1, 2]], -1), "root_token"),
        (lambda: M.prefix_tree([[1, -2]], 0), r"sequences\[0\]\[1\]"),
        (lambda: M.prefix_tree([1, 2], 0), r"sequences\[0\]"),
        (lambda: M.prefix_tree("ab", 0), "sequences"),
        (lambda: M.prefix_tree([[[1]], [[2]]], [0]), "root_token has 1"),
        (lambda: M.prefix_tree([[1]], 0, pad_token=-1), "pad_token"),
        (lambda: M.d2sd_branches(0, [1, 2], [3], [[4]]), r"prefix_lengths\[0\]"),
        (lambda: M.d2sd_branches(0, [1, 2], [1, 0], [[4]]), "redrafts"),
        (lambda: M.d2sd_branches(0, [1, 2.5], [1], [[4]]), r"first_draft\[1\]"),
        (lambda: M.d2sd_branches([0, 1], [[1, 2]], [[1]], [[[4]]]), "first_draft must have one entry"),
    ],
)
def test_invalid_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------
# prefix trees


def path_tokens(t: M.TreeSuffix, node: int):
    out = []
    while node > 0:
        out.append(int(t.tokens[node]))
        node = int(t.parents[node])
    assert node == 0
    return out[::-1]


def test_prefix_tree_example():
    t = M.prefix_tree([[5, 6, 7], [5, 8], [9]], 1)
    assert t.tokens.tolist() == [1, 5, 6, 7, 8, 9]
    assert t.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    assert t.positions.tolist() == [0, 1, 2, 3, 2, 1]
    assert t.leaf_of_branch.tolist() == [3, 4, 5]
    assert torch.equal(
        t.dense(),
        grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .
        x x . . x .
        x . . . . x
    """),
    )
    assert isinstance(t.mask, M.SuffixMask) and t.mask.words is t.words
    # duplicates, a branch that is a prefix of another, an empty branch
    t = M.prefix_tree([[5, 6], [5, 6], [5], []], 1)
    assert t.tokens.tolist() == [1, 5, 6] and t.leaf_of_branch.tolist() == [2, 2, 1, 0]
    t = M.prefix_tree([], 7)
    assert t.tokens.tolist() == [7] and t.words.tolist() == [[1]] and t.leaf_of_branch.shape == (0,)


@pytest.mark.parametrize("seed", range(5))
def test_prefix_tree_round_trips(seed):
    rng = random.Random(seed)
    base = [rng.randrange(6) for _ in range(12)]
    branches = []
    for _ in range(rng.randrange(1, 9)):
        cut = rng.randrange(len(base) + 1)
        branches.append(base[:cut] + [rng.randrange(6) for _ in range(rng.randrange(6))])
    t = M.prefix_tree(branches, 99)
    n = t.tokens.shape[0]
    # every branch is the root-to-leaf path of its leaf
    for k, branch in enumerate(branches):
        assert path_tokens(t, int(t.leaf_of_branch[k])) == branch
    # shared prefixes share nodes: one node per distinct non-empty prefix, plus the root
    prefixes = {tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
    assert n == len(prefixes) + 1
    # topological order, distinct sibling tokens
    par = t.parents.tolist()
    assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, n))
    sib = {(par[i], int(t.tokens[i])) for i in range(1, n)}
    assert len(sib) == n - 1
    # consistent with tree_mask
    words, depth = dspec.tree_mask(t.parents[None])
    assert torch.equal(t.words, words[0]) and torch.equal(t.positions, depth[0])
    assert t.positions.tolist() == [len(path_tokens(t, i)) for i in range(n)]


def test_prefix_tree_batched():
    reqs = [[[5, 6, 7], [5, 8]], [[1]], []]
    roots = [10, 11, 12]
    t = M.prefix_tree(reqs, roots, pad_token=3)
    assert t.tokens.shape == (3, 5) and t.words.shape == (3, 5, 1) and t.leaf_of_branch.shape == (3, 2)
    for b, (req, root) in enumerate(zip(reqs, roots)):
        one = M.prefix_tree(req, root)
        n = one.tokens.shape[0]
        assert torch.equal(t.tokens[b, :n], one.tokens) and (t.tokens[b, n:] == 3).all()
        assert torch.equal(t.parents[b, :n], one.parents) and (t.parents[b, n:] == -1).all()
        assert torch.equal(t.positions[b, :n], one.positions) and (t.positions[b, n:] == 0).all()
        assert torch.equal(t.dense()[b, :n, :n], one.dense())
        assert torch.equal(t.dense()[b, n:], torch.eye(5, dtype=torch.bool)[n:])  # padding: itself only
        k = one.leaf_of_branch.shape[0]
        assert torch.equal(t.leaf_of_branch[b, :k], one.leaf_of_branch) and (t.leaf_of_branch[b, k:] == -1).all()
    # tensors work as well
    t2 = M.prefix_tree([torch.tensor([[5, 6], [5, 7]])], torch.tensor([10]))
    assert t2.tokens.tolist() == [[10, 5, 6, 7]]


def test_d2sd_branches():
    t = M.d2sd_branches(1, [10, 11, 12], [1, 0], [[20, 21], [30]])
    assert t.tokens.tolist() == [1, 10, 11, 12, 20, 21, 30]
    assert t.parents.tolist() == [-1, 0, 1, 2, 1, 4, 0]
    assert t.leaf_of_branch.tolist() == [3, 5, 6]
    assert [path_tokens(t, int(v)) for v in t.leaf_of_branch] == [[10, 11, 12], [10, 20, 21], [30]]
    # a re-draft that repeats the first draft's token merges into its node
    t = M.d2sd_branches(1, [10, 11, 12], [2, 1], [[12, 13], [11]])
    assert t.tokens.tolist() == [1, 10, 11, 12, 13]
    assert t.leaf_of_branch.tolist() == [3, 4, 2]
    # tensors, batched
    first = torch.tensor([[10, 11, 12], [10, 11, 13]])
    lengths = torch.tensor([[1, 0], [2, 3]])
    redrafts = torch.tensor([[[20, 21], [30, 31]], [[40, 41], [50, 51]]])
    tb = M.d2sd_branches(torch.tensor([1, 2]), first, lengths, redrafts)
    for b in range(2):
        one = M.d2sd_branches(int(b + 1), first[b], lengths[b], redrafts[b])
        n = one.tokens.shape[0]
        assert torch.equal(tb.tokens[b, :n], one.tokens)
        assert torch.equal(tb.dense()[b, :n, :n], one.dense())
        assert torch.equal(tb.leaf_of_branch[b], one.leaf_of_branch)


def test_numpy_inputs():
    np = pytest.importorskip("numpy")
    t = M.d2sd_branches(np.int64(1), np.array([10, 11]), np.array([1]), np.array([[20]]))
    assert t.tokens.tolist() == [1, 10, 11, 20]
    assert M.spiffy_draft_graph(np.int32(2), np.array([0])).positions.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="sequences must be a 2-D integer array"):
        M.prefix_tree(np.array([[1.0, 2.0]]), 0)


@pytest.mark.parametrize("seed", range(4))
def test_padded_prefix_tree_equals_prefix_tree(seed):
    """The array-built tree (what D2SD calls per cycle) is prefix_tree's, node for node, on
    random branches over a 3-token alphabet (many shared prefixes), empty branches and
    ragged lengths included."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        b, k, m = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 5), (1, 6), (1, 8)))
        branches = torch.randint(0, 3, (b, k, m), generator=g)
        lengths = torch.randint(0, m + 1, (b, k), generator=g)
        roots = torch.randint(0, 50, (b,), generator=g)
        got = M.padded_prefix_tree(branches, lengths, roots, pad_token=7)
        want = M.prefix_tree(
            [[branches[i, j, : lengths[i, j]].tolist() for j in range(k)] for i in range(b)],
            roots.tolist(),
            pad_token=7,
        )
        for field in got._fields:
            assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_padded_prefix_tree_rejects_bad_input():
    br, ln, roots = torch.zeros(2, 3, 4, dtype=torch.int64), torch.full((2, 3), 4), torch.tensor([1, 2])
    for args, match in (
        ((br.float(), ln, roots), "branches must be a 3-D integer"),
        ((br, ln[:, :2], roots), "lengths must be"),
        ((br, ln, roots[:1]), "lengths must be"),
        ((br, ln + 1, roots), "lengths must lie in"),
        ((br - 1, ln, roots), "token ids >= 0"),
        ((br, ln, roots - 5), "token ids >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            M.padded_prefix_tree(*args)


def test_verify_tree_accepts_a_prefix_tree():
    t = M.d2sd_branches(1, [10, 11, 12], [1, 0], [[20, 21], [30]])
    n, vocab = t.tokens.shape[0], 40
    # the target agrees with branch 1 (10, 20, 21) and then says 7
    logits = torch.zeros(1, n, vocab)
    want = {0: 10, 1: 20, 4: 21, 5: 7}
    for node, tok in want.items():
        logits[0, node, tok] = 10.0
    out = dspec.verify_tree(t.tokens[None], t.parents[None], logits)
    assert out.path[0].tolist()[:3] == [1, 4, 5] and out.num_accepted.tolist() == [3]
    assert out.tokens[0].tolist()[:4] == [10, 20, 21, 7]
    # the batched layout (with padding nodes) works too
    tb = M.prefix_tree([[[10, 11, 12], [10, 20, 21], [30]], [[10]]], [1, 2])
    logits_b = torch.zeros(2, tb.tokens.shape[1], vocab)
    logits_b[0] = logits[0]
    logits_b[1, 0, 10] = logits_b[1, 1, 3] = 10.0
    out = dspec.verify_tree(tb.tokens, tb.parents, logits_b)
    assert out.num_accepted.tolist() == [3, 1]
    assert out.tokens[1].tolist()[:2] == [10, 3]

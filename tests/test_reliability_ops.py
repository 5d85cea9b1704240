"""The C++ thread pool across fork, the caller's thread count in every C++ helper, and the
ops' input checks (types, meta tensors, bools as numbers, zero-size dimensions, strides)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dspec
from dspec import _backend
from dspec.reference import attention as ref_attention

needs_cpp = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_script(code: str, timeout: float, threads: int = 1) -> str:
    """Run ``code`` in a fresh interpreter (DSPEC_NUM_THREADS / OMP threads = ``threads``);
    its stdout, after asserting it exited 0 within ``timeout`` seconds."""
    env = dict(
        os.environ,
        DSPEC_NUM_THREADS=str(threads),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.pop("DSPEC_CPU_THREADS", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not finish within {timeout} s (a hang): {e.stdout!r} {e.stderr!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# ------------------------------------------------------------------------------- fork

_FORK_PRELUDE = """
    import multiprocessing as mp, os, sys, time
    import torch, dspec

    def in_child(fn, timeout=60):
        # fn's result from a fork child; None when the child hangs (killed) or fails
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=lambda: q.put(fn()))
        p.start()
        try:
            out = q.get(timeout=timeout)      # before join: a child exits once its queue is drained
        except Exception:
            out = None
        p.join(10)
        if p.is_alive():
            p.kill(); p.join()
        return out
"""


@needs_cpp
def test_fork_child_after_ssd_finishes_with_the_same_tokens():
    out = _run_script(
        _FORK_PRELUDE
        + """
    bd = dspec.load("tiny-bd")
    run = lambda: dspec.generate(bd, "def add(a, b):", method="ssd", max_new_tokens=12).tokens
    parent = run()
    child = in_child(run)
    assert child is not None, "the fork child hung or failed"
    assert child == parent, (child, parent)
    x = torch.randn(64, 300, 64); l = torch.randn(64, 300)
    dspec.merge_states(x, l, x, l)
    child = in_child(run)
    assert child == parent, (child, parent)
    print("ok")
    """,
        timeout=240,
    )
    assert out.strip().endswith("ok")


@needs_cpp
def test_fork_child_after_the_pool_ran_on_two_threads():
    """The parent's pool workers are asleep on its condition variable when the child forks:
    the child's first multi-threaded call must build its own pool, not notify that one."""
    out = _run_script(
        _FORK_PRELUDE
        + """
    x = torch.randn(64, 300, 64); l = torch.randn(64, 300)
    ref = dspec.merge_states(x, l, x, l, backend="cpp")
    time.sleep(0.1)                                   # workers stop spinning, sleep on the cv
    child = in_child(lambda: torch.equal(dspec.merge_states(x, l, x, l, backend="cpp")[0], ref[0]))
    assert child is not None, "the fork child hung or failed"
    assert child
    logits = torch.randn(64, 50000)
    stats = dspec.token_stats(logits, backend="cpp").token.tolist()
    time.sleep(0.1)
    assert in_child(lambda: dspec.token_stats(logits, backend="cpp").token.tolist()) == stats
    print("ok")
    """,
        timeout=240,
        threads=2,
    )
    assert out.strip().endswith("ok")


# ----------------------------------------------------------------------- thread counts

_THREADS_PRELUDE = """
    import os, torch, dspec
    def threads():
        return len(os.listdir("/proc/self/task"))
    torch.set_num_threads(1)
    torch.ones(4, 4) @ torch.ones(4, 4)              # torch's own pools, at 1 thread
"""


@needs_cpp
@pytest.mark.parametrize(
    "setup,call",
    [
        ("x = torch.randn(64, 300, 64); l = torch.randn(64, 300)", "dspec.merge_states(x, l, x, l, backend='cpp')"),
        ("bd = dspec.load('tiny-bd')", "dspec.generate(bd, 'def add(a, b):', method='ssd', max_new_tokens=12)"),
        ("bd = dspec.load('tiny-bd')", "dspec.generate(bd, 'def add(a, b):', method='spiffy', max_new_tokens=12)"),
        ("x = torch.randn(64, 50000)", "dspec.token_stats(x, backend='cpp')"),
        (
            "d = torch.zeros(64, 4, dtype=torch.long); x = torch.randn(64, 5, 4000)",
            "dspec.verify_chain(d, x, backend='cpp'); dspec.verify_chain(d, x, temperature=1.0, backend='cpp')",
        ),
    ],
    ids=["merge_states", "ssd", "spiffy", "token_stats", "verify_chain"],
)
def test_one_thread_is_honoured(setup, call):
    """With one thread asked for, no C++ helper starts a thread of its own."""
    out = _run_script(
        _THREADS_PRELUDE
        + f"""
    {setup}
    base = threads()
    {call}
    print(base, threads())
    """,
        timeout=180,
    )
    base, after = map(int, out.split()[-2:])
    assert after <= base, f"{after} threads after the call, {base} before"


# ----------------------------------------------------------------- valid input accepted


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if _backend.cpp_available() else []))
def test_tree_mask_of_a_broadcast(backend):
    parents = torch.tensor([[-1, 0, 1, 1, 0]])
    got = dspec.tree_mask(parents.expand(3, 5), backend=backend)
    one = dspec.tree_mask(parents, backend="torch")
    assert torch.equal(got.words, one.words.expand(3, -1, -1))
    assert torch.equal(got.depth, one.depth.expand(3, -1))
    single = dspec.tree_mask(torch.tensor([-1, 0, 1, 1, 0]).expand(1, 5), backend=backend)
    assert torch.equal(single.words, one.words)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if _backend.cpp_available() else []))
def test_row_ops_on_broadcast_rows(backend):
    logits = torch.randn(7).expand(1, 7)  # row stride 0
    ref = dspec.token_stats(logits.contiguous(), backend="torch")
    assert torch.equal(dspec.token_stats(logits, backend=backend).token, ref.token)
    mask = torch.tensor([True, False, True]).expand(1, 3)
    assert dspec.pack_mask(mask, backend=backend).tolist() == [[5]]


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if _backend.cpp_available() else []))
def test_merge_states_head_dim_zero(backend):
    o = torch.randn(3, 4, 0)
    la, lb = torch.randn(3, 4), torch.randn(3, 4)
    la[0, 0] = lb[0, 0] = float("-inf")
    exp_o, exp_lse = ref_attention.merge_states(o, la, o, lb)
    got_o, got_lse = dspec.merge_states(o, la, o, lb, backend=backend)
    assert got_o.shape == exp_o.shape == (3, 4, 0)
    torch.testing.assert_close(got_lse, exp_lse, equal_nan=True)


# ------------------------------------------------------------------ NaN and sm_scale

_CASCADE_BACKENDS = ["torch"] + (["cpp"] if _backend.cpp_available() else [])


@pytest.mark.parametrize("backend", _CASCADE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix", [False, True])
def test_cascade_attention_nan_query_row_propagates(backend, dtype, prefix):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 5, 2, 16, generator=g).to(dtype) for _ in range(2))
    q[1, 2, 3, 7] = float("nan")
    mask = dspec.masks.causal(5).words.clone()
    mask[4] = 0  # row 4 sees no suffix key
    q[0, 4, 0, 0] = float("nan")
    kw = {}
    if prefix:
        kw = dict(
            prefix_k=torch.randn(6, 2, 16, generator=g).to(dtype),
            prefix_v=torch.randn(6, 2, 16, generator=g).to(dtype),
            prefix_indptr=torch.tensor([0, 0, 6]),
        )
    out, lse = dspec.cascade_attention(q, k, v, mask, return_lse=True, backend=backend, **kw)
    assert torch.isnan(out[1, 2, 3]).all() and torch.isnan(lse[1, 2, 3])
    # a row that sees no key stays out 0 / lse -inf (request 0 has no prefix)
    assert (out[0, 4, 0] == 0).all() and lse[0, 4, 0] == float("-inf")
    nan_rows = torch.isnan(out).any(-1)
    assert int(nan_rows.sum()) == 1 and bool(nan_rows[1, 2, 3])
    assert int(torch.isnan(lse).sum()) == 1
    exp_out, exp_lse = ref_attention.cascade_attention(q, k, v, mask, return_lse=True, **kw)
    torch.testing.assert_close(lse, exp_lse, equal_nan=True, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), exp_out.float(), equal_nan=True, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", _CASCADE_BACKENDS)
@pytest.mark.parametrize(
    "scale",
    [float("nan"), float("inf"), -float("inf"), 1e39, "x", [1.0], True, complex(1, 0), torch.tensor([1.0, 2.0])],
)
def test_cascade_attention_bad_sm_scale(backend, scale):
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError, match="sm_scale"):
        dspec.cascade_attention(q, k, k, sm_scale=scale, backend=backend)
    with pytest.raises(ValueError, match="sm_scale"):
        dspec.CascadeAttentionPlan(1, 3, 2, 1, 8, torch.float32, "cpu", sm_scale=scale, backend=backend)


@pytest.mark.parametrize("backend", _CASCADE_BACKENDS)
@pytest.mark.parametrize("scale", [0.5, 2, -0.25, 0.0, torch.tensor(0.5)])
def test_cascade_attention_finite_sm_scale_agrees(backend, scale):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 8, generator=g)
    k, v = torch.randn(1, 3, 1, 8, generator=g), torch.randn(1, 3, 1, 8, generator=g)
    got = dspec.cascade_attention(q, k, v, sm_scale=scale, backend=backend)
    exp = ref_attention.cascade_attention(q.double(), k.double(), v.double(), sm_scale=float(scale))
    torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ bad input, every op


def _logits(*shape):
    return torch.randn(*shape)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


_DRAFTS = torch.tensor([[1, 2], [0, 3]])
_LOGITS = torch.randn(2, 3, 5)
_PARENTS = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
_TREE_TOKENS = torch.tensor([[0, 1, 2], [0, 3, 4]])
_TREE_LOGITS = torch.randn(2, 3, 5)
_Q, _K = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
_O, _L = torch.randn(2, 4), torch.zeros(2)

BAD_CALLS = {
    # cascade_attention
    "cascade_zero_head_dim": (
        lambda: dspec.cascade_attention(torch.randn(1, 3, 2, 0), torch.randn(1, 3, 1, 0), torch.randn(1, 3, 1, 0)),
        "D",
    ),
    "cascade_zero_heads": (lambda: dspec.cascade_attention(torch.randn(1, 3, 0, 8), _K, _K), "head"),
    "cascade_q_list": (lambda: dspec.cascade_attention(_Q.tolist(), _K, _K), "q"),
    "cascade_meta_q": (
        lambda: dspec.cascade_attention(_meta(1, 3, 2, 8), _meta(1, 3, 1, 8), _meta(1, 3, 1, 8)),
        "meta",
    ),
    "cascade_sm_scale_list": (lambda: dspec.cascade_attention(_Q, _K, _K, sm_scale=[1.0]), "sm_scale"),
    "cascade_sm_scale_str": (lambda: dspec.cascade_attention(_Q, _K, _K, sm_scale="x"), "sm_scale"),
    "cascade_sm_scale_bool": (lambda: dspec.cascade_attention(_Q, _K, _K, sm_scale=True), "sm_scale"),
    "cascade_return_lse_str": (lambda: dspec.cascade_attention(_Q, _K, _K, return_lse="yes"), "return_lse"),
    "cascade_backend_int": (lambda: dspec.cascade_attention(_Q, _K, _K, backend=3), "backend"),
    "cascade_mask_list": (lambda: dspec.cascade_attention(_Q, _K, _K, [[7], [7], [7]]), "mask"),
    "cascade_prefix_indptr_list": (
        lambda: dspec.cascade_attention(
            _Q, _K, _K, prefix_k=torch.randn(2, 1, 8), prefix_v=torch.randn(2, 1, 8), prefix_indptr=[0, 2]
        ),
        "prefix_indptr",
    ),
    "plan_device_gpu0": (lambda: dspec.CascadeAttentionPlan(1, 3, 2, 1, 8, torch.float32, "gpu0"), "device"),
    "plan_device_meta": (lambda: dspec.CascadeAttentionPlan(1, 3, 2, 1, 8, torch.float32, "meta"), "device"),
    "plan_device_float": (lambda: dspec.CascadeAttentionPlan(1, 3, 2, 1, 8, torch.float32, 1.5), "device"),
    "plan_dtype_str": (lambda: dspec.CascadeAttentionPlan(1, 3, 2, 1, 8, "float32"), "dtype"),
    "plan_head_dim_bool": (lambda: dspec.CascadeAttentionPlan(1, 3, 2, 1, True, torch.float32), "head_dim"),
    # merge_states
    "merge_list": (lambda: dspec.merge_states(_O.tolist(), _L, _O, _L), "o_a"),
    "merge_lse_list": (lambda: dspec.merge_states(_O, [0.0, 0.0], _O, _L), "lse_a"),
    "merge_meta": (lambda: dspec.merge_states(_meta(2, 4), _meta(2), _meta(2, 4), _meta(2)), "meta"),
    # verify_chain
    "chain_num_drafts_list": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, num_drafts=[1, 2]), "num_drafts"),
    "chain_draft_probs_list": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, draft_probs=[[0.1]]), "draft_probs"),
    "chain_generator_int": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, temperature=1.0, generator=123), "generator"),
    "chain_generator_greedy": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, generator="x"), "generator"),
    "chain_meta": (lambda: dspec.verify_chain(_meta(2, 2, dtype=torch.long), _meta(2, 3, 5)), "meta"),
    "chain_meta_logits": (lambda: dspec.verify_chain(_DRAFTS, _meta(2, 3, 5)), "meta"),
    "chain_temperature_bool": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, temperature=True), "temperature"),
    "chain_temperature_str": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, temperature="1.0"), "temperature"),
    "chain_coins_list": (
        lambda: dspec.verify_chain(_DRAFTS, _LOGITS, temperature=1.0, coins=[[0.5, 0.5]] * 2),
        "coins",
    ),
    "chain_tokens_list": (lambda: dspec.verify_chain([[1, 2], [0, 3]], _LOGITS), "draft_tokens"),
    "chain_backend_list": (lambda: dspec.verify_chain(_DRAFTS, _LOGITS, backend=["cpp"]), "backend"),
    # verify_tree
    "tree_generator_str": (
        lambda: dspec.verify_tree(_TREE_TOKENS, _PARENTS, _TREE_LOGITS, temperature=1.0, generator="x"),
        "generator",
    ),
    "tree_temperature_bool": (
        lambda: dspec.verify_tree(_TREE_TOKENS, _PARENTS, _TREE_LOGITS, temperature=True),
        "temperature",
    ),
    "tree_meta": (
        lambda: dspec.verify_tree(_meta(2, 3, dtype=torch.long), _meta(2, 3, dtype=torch.long), _meta(2, 3, 5)),
        "meta",
    ),
    "tree_parents_list": (lambda: dspec.verify_tree(_TREE_TOKENS, _PARENTS.tolist(), _TREE_LOGITS), "parents"),
    # token_stats / topk / mass_candidates
    "stats_temperature_bool": (lambda: dspec.token_stats(_logits(2, 5), temperature=True), "temperature"),
    "stats_temperature_str": (lambda: dspec.token_stats(_logits(2, 5), temperature="2"), "temperature"),
    "stats_meta": (lambda: dspec.token_stats(_meta(2, 5)), "meta"),
    "stats_list": (lambda: dspec.token_stats([[1.0, 2.0]]), "logits"),
    "topk_k_bool": (lambda: dspec.topk_tokens(_logits(2, 5), True), "k"),
    "topk_temperature_bool": (lambda: dspec.topk_tokens(_logits(2, 5), 2, temperature=True), "temperature"),
    "topk_meta": (lambda: dspec.topk_tokens(_meta(2, 5), 2), "meta"),
    "mass_tau_bool": (lambda: dspec.mass_candidates(_logits(2, 5), True, 2), "tau"),
    "mass_tau_str": (lambda: dspec.mass_candidates(_logits(2, 5), "0.5", 2), "tau"),
    "mass_meta": (lambda: dspec.mass_candidates(_meta(2, 5), 0.5, 2), "meta"),
    # boundary
    "boundary_meta": (lambda: dspec.boundary_posterior(_meta(2, 3)), "meta"),
    "boundary_list": (lambda: dspec.boundary_posterior([[0.5, 0.5]]), "conf"),
    "rejection_k_bool": (lambda: dspec.rejection_boundaries(torch.full((1, 3), 0.5), True), "k"),
    "expected_meta": (lambda: dspec.expected_accept_length(_meta(2, 3)), "meta"),
    # masks
    "pack_meta": (lambda: dspec.pack_mask(_meta(2, 3, dtype=torch.bool)), "meta"),
    "pack_list": (lambda: dspec.pack_mask([[True]]), "mask"),
    "unpack_meta": (lambda: dspec.unpack_mask(_meta(2, 1, dtype=torch.int32), 3), "meta"),
    "unpack_num_keys_bool": (lambda: dspec.unpack_mask(torch.zeros(2, 1, dtype=torch.int32), True), "num_keys"),
    "tree_mask_meta": (lambda: dspec.tree_mask(_meta(1, 3, dtype=torch.long)), "meta"),
    "tree_mask_list": (lambda: dspec.tree_mask([[-1, 0]]), "parents"),
    "tree_mask_backend_int": (lambda: dspec.tree_mask(_PARENTS, backend=0), "backend"),
    "masks_causal_meta_n": (lambda: dspec.masks.causal(torch.tensor(3, device="meta")), "meta"),
    "masks_causal_device_meta": (lambda: dspec.masks.causal(3, device="meta"), "device"),
    "masks_causal_device_bad": (lambda: dspec.masks.causal(3, device="gpu0"), "device"),
    "masks_causal_device_float": (lambda: dspec.masks.causal(3, device=0.5), "device"),
    "masks_causal_bool": (lambda: dspec.masks.causal(True), "n"),
    "masks_tree_meta": (lambda: dspec.masks.tree(_meta(3, dtype=torch.long)), "meta"),
    "masks_spiffy_meta": (lambda: dspec.masks.spiffy_draft_graph(2, _meta(1, dtype=torch.long)), "meta"),
    "masks_prefix_tree_meta": (lambda: dspec.masks.prefix_tree(_meta(1, 2, dtype=torch.long), 0), "meta"),
    "masks_padded_meta": (
        lambda: dspec.masks.padded_prefix_tree(
            _meta(1, 1, 2, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        ),
        "meta",
    ),
    "masks_padded_str": (lambda: dspec.masks.padded_prefix_tree("abc", [[1]], [0]), "branches"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_is_a_value_error_naming_the_argument(name):
    call, names = BAD_CALLS[name]
    with pytest.raises(ValueError, match=names):
        call()


def test_numbers_still_accepted():
    logits = torch.randn(2, 5)
    import numpy as np

    for t in (1, 0.5, np.float32(0.7), np.int64(2), torch.tensor(0.9)):
        dspec.token_stats(logits, temperature=t)
        dspec.topk_tokens(logits, 2, temperature=t)
        dspec.verify_chain(_DRAFTS, _LOGITS, temperature=t, generator=torch.Generator().manual_seed(0))
    dspec.mass_candidates(logits, np.float64(0.5), 2)
    dspec.cascade_attention(_Q, _K, _K, return_lse=np.bool_(True))
    dspec.verify_chain(_DRAFTS, _LOGITS, temperature=0.0, generator=torch.Generator())
    assert dspec.masks.causal(3, device=torch.device("cpu")).words.device.type == "cpu"

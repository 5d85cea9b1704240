import math

import pytest
import torch

import dspec
from conftest import assert_close_nan, backends_for, device_backends
from dspec.reference import topk as reference
from logits_cases import key_scan_rows, special_rows

PROVIDED = ("torch", "triton", "cpp")
DTYPES = [(torch.float32, 1e-6, 1e-4), (torch.float16, 1e-6, 1e-4), (torch.bfloat16, 1e-6, 1e-4)]
SHAPES = [(1, 1, 1), (7, 2, 2), (7, 111, 5), (1, 1000, 32), (7, 777, 17), (3, 300, 100), (2, 70, 70)]


def _logits(rows, vocab, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return special_rows(torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(device)


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("rows,vocab,k", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 1e-3, 1e3])
def test_topk_matches_reference(device, backend, dtype, atol, rtol, rows, vocab, k, temperature):
    if backend == "triton" and k > 32:
        pytest.skip("the Triton kernel takes k <= 32")
    x = _logits(rows, vocab, dtype, device, rows + vocab + k)
    tokens, probs = dspec.topk_tokens(x, k, temperature=temperature, backend=backend)
    exp_tokens, exp_probs = reference.topk_tokens(x.cpu(), k, temperature)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows, k)
    assert torch.equal(tokens.cpu(), exp_tokens)
    assert_close_nan(probs, exp_probs, rtol=rtol, atol=atol, name="probs")


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("rows,vocab,k", SHAPES)
@pytest.mark.parametrize("tau", [0.3, 0.8, 0.95])
def test_mass_matches_reference(device, backend, dtype, atol, rtol, rows, vocab, k, tau):
    if backend == "triton" and k > 32:
        pytest.skip("the Triton kernel takes k <= 32")
    x = _logits(rows, vocab, dtype, device, 7 * rows + vocab + k)
    tokens, logprobs, count = dspec.mass_candidates(x, tau, k, temperature=0.5, backend=backend)
    exp_tokens, exp_logprobs, exp_count = reference.mass_candidates(x.cpu(), tau, k, 0.5)
    assert count.dtype == torch.int64 and count.shape == (rows,)
    assert torch.equal(count.cpu(), exp_count)
    assert torch.equal(tokens.cpu(), exp_tokens)
    assert_close_nan(logprobs, exp_logprobs, rtol=rtol, atol=1e-5, name="logprobs")


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("mass", [False, True])
def test_triton_vocab_split(splits, mass):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in [b for _, b in backends_for(device, PROVIDED)]:
        pytest.skip("no triton backend here")
    from dspec.kernels.topk import mass_candidates_triton, topk_tokens_triton

    x = _logits(7, 1500, torch.float32, device, splits)
    x[6, 1499] = x[6, 3] = 50.0  # a tie split across programs: the lower id first
    if mass:
        out = mass_candidates_triton(x, 0.9, 8, 2.0, num_splits=splits, block=128)
        exp = reference.mass_candidates(x.cpu(), 0.9, 8, 2.0)
        assert torch.equal(out[0].cpu(), exp[0]) and torch.equal(out[2].cpu(), exp[2])
        assert_close_nan(out[1], exp[1], rtol=1e-4, atol=1e-5, name="logprobs")
    else:
        out = topk_tokens_triton(x, 8, 2.0, num_splits=splits, block=128)
        exp = reference.topk_tokens(x.cpu(), 8, 2.0)
        assert torch.equal(out[0].cpu(), exp[0])
        assert_close_nan(out[1], exp[1], rtol=1e-4, atol=1e-6, name="probs")
        assert out[0][6, :2].tolist() == [3, 1499]


@device_backends(PROVIDED)
def test_worst_case_ascending_and_ties(device, backend):
    """Ascending logits insert into the buffer on every tile; constant rows are all ties."""
    x = torch.stack([torch.arange(600.0), torch.zeros(600), -torch.arange(600.0)]).to(device)
    tokens, probs = dspec.topk_tokens(x, 4, backend=backend)
    assert tokens.tolist() == [[599, 598, 597, 596], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert_close_nan(probs, reference.topk_tokens(x.cpu(), 4)[1], rtol=1e-4, atol=1e-7)
    # -0.0 and +0.0 are equal logits: the lower id ranks first
    z = torch.tensor([[-1.0, 0.0, -0.0, -2.0]], device=device)
    z[0, 1] = -0.0
    z[0, 2] = 0.0
    assert dspec.topk_tokens(z, 2, backend=backend)[0].tolist() == [[1, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 1000, 49157])
def test_cpp_key_scan_edge_cases(dtype, vocab):
    """The CPU scan on sortable keys: signs of zero, a negative NaN, ties, lane tails."""
    if ("cpu", "cpp") not in backends_for("cpu", PROVIDED):
        pytest.skip("dspec._C not built")
    x = key_scan_rows(vocab, dtype)
    for k in (1, 3):
        tokens, probs = dspec.topk_tokens(x, k, backend="cpp")
        ref_tokens, ref_probs = reference.topk_tokens(x, k)
        assert torch.equal(tokens, ref_tokens)
        assert_close_nan(probs, ref_probs, rtol=1e-4, atol=1e-6)
        mt, ml, mc = dspec.mass_candidates(x, 0.9, k, backend="cpp")
        rt, rl, rc = reference.mass_candidates(x, 0.9, k)
        assert torch.equal(mt, rt) and torch.equal(mc, rc)
        assert_close_nan(ml, rl, rtol=1e-4, atol=1e-5)


def test_mass_semantics():
    x = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 0.0, 0.0, float("-inf")]])
    tokens, logprobs, count = dspec.mass_candidates(x, 0.9, 3)
    assert count.tolist() == [2, 3]
    assert tokens.tolist() == [[0, 1, -1], [0, 1, 2]]
    assert math.isclose(logprobs[1, 0].item(), -math.log(3), rel_tol=1e-6)
    # the mass never reaches tau within max_m -> max_m; zero-probability tokens never count
    _, _, count = dspec.mass_candidates(x, 0.999, 2)
    assert count.tolist() == [2, 2]
    _, lp, count = dspec.mass_candidates(x[1:], 1.0, 4)
    assert count.tolist() == [3] and lp[0, 3].item() == float("-inf")


def test_topk_sum_matches_softmax():
    x = torch.randn(3, 50)
    _, probs = dspec.topk_tokens(x, 50)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    torch.testing.assert_close(probs, torch.softmax(x, -1).sort(-1, descending=True).values)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: dspec.topk_tokens(torch.zeros(2, 5), 6), "k must be <= V"),
        (lambda: dspec.topk_tokens(torch.zeros(2, 5), 0), "k must be >= 1"),
        (lambda: dspec.topk_tokens(torch.zeros(2, 5), 2.0), "k must be an int"),
        (lambda: dspec.topk_tokens(torch.zeros(2, 0), 1), "empty vocabulary"),
        (lambda: dspec.topk_tokens(torch.zeros(2, 64), 33, backend="triton"), "k <= 32"),
        (lambda: dspec.mass_candidates(torch.zeros(2, 5), 0.0, 2), "tau"),
        (lambda: dspec.mass_candidates(torch.zeros(2, 5), 1.5, 2), "tau"),
        (lambda: dspec.mass_candidates(torch.zeros(2, 5), float("nan"), 2), "tau"),
        (lambda: dspec.mass_candidates(torch.zeros(2, 5), 0.5, 9), "max_m must be <= V"),
        (lambda: dspec.mass_candidates(torch.zeros(2, 5), 0.5, 2, temperature=0), "temperature"),
    ],
)
def test_bad_input_raises_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()

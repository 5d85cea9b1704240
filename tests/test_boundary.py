import pytest
import torch

import dspec
from conftest import assert_close_nan, device_backends
from dspec.reference import boundary as reference

PROVIDED = ("torch", "triton")
DTYPES = [(torch.float32, 1e-30, 1e-4), (torch.float16, 1e-30, 1e-4), (torch.bfloat16, 1e-30, 1e-4)]


def _conf(batch, length, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(batch, length, generator=g)
    if batch >= 3 and length >= 3:
        c[0, :3] = torch.tensor([0.5, 1.0, 0.5])  # exact ties in r
        c[1, 1] = 0.0  # r is 0 past the first rejection-certain draft
        c[2] = 1.0  # every r_i is 0 for i < L
    return c.to(dtype).to(device)


@device_backends(PROVIDED)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("batch,length,k", [(1, 1, 1), (7, 5, 3), (7, 16, 16), (3, 33, 4), (20, 64, 8)])
def test_matches_reference(device, backend, dtype, atol, rtol, batch, length, k):
    c = _conf(batch, length, dtype, device, batch * 100 + length)
    r = dspec.boundary_posterior(c, backend=backend)
    assert r.shape == (batch, length + 1) and r.dtype == torch.float32
    assert_close_nan(r, reference.boundary_posterior(c.cpu()), rtol=rtol, atol=atol, name="r")
    lengths, r_top = dspec.rejection_boundaries(c, k, backend=backend)
    exp_lengths, exp_r = reference.rejection_boundaries(c.cpu(), k)
    assert lengths.dtype == torch.int64
    assert torch.equal(lengths.cpu(), exp_lengths)
    assert_close_nan(r_top, exp_r, rtol=rtol, atol=atol, name="r_top")
    e = dspec.expected_accept_length(c, backend=backend)
    assert_close_nan(e, reference.expected_accept_length(c.cpu()), rtol=rtol, atol=1e-6, name="E")


@device_backends(PROVIDED)
def test_underflow_ranking(device, backend):
    """L = 64 tiny confidences: r underflows to 0 but the log-space ranking stays exact."""
    c = torch.full((2, 64), 1e-3, device=device)
    c[1] = torch.linspace(0.01, 0.02, 64)
    lengths, r = dspec.rejection_boundaries(c, 6, backend=backend)
    assert lengths[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert lengths.cpu().equal(reference.rejection_boundaries(c.cpu(), 6)[0])
    r_all = dspec.boundary_posterior(c, backend=backend)
    assert r_all[0, -1].item() == 0.0  # 1e-192 underflows float32
    assert torch.allclose(r_all.sum(-1).cpu(), torch.ones(2))


def test_semantics():
    c = torch.tensor([[0.9, 0.5, 0.9], [1.0, 1.0, 1.0]])
    r = dspec.boundary_posterior(c)
    torch.testing.assert_close(r[0], torch.tensor([0.1, 0.45, 0.045, 0.405]))
    torch.testing.assert_close(r.sum(-1), torch.ones(2))
    assert dspec.rejection_boundaries(c, 3)[0].tolist() == [[1, 0, 2], [0, 1, 2]]
    torch.testing.assert_close(dspec.expected_accept_length(c), torch.tensor([0.9 + 0.45 + 0.405, 3.0]))
    empty = torch.zeros(2, 0)
    assert dspec.boundary_posterior(empty).tolist() == [[1.0], [1.0]]
    assert dspec.expected_accept_length(empty).tolist() == [0.0, 0.0]


def test_from_token_stats_probabilities():
    """The intended feed: a drafter's per-position confidences from token_stats."""
    logits = torch.randn(4, 8, 300)
    conf = dspec.token_stats(logits).prob
    torch.testing.assert_close(dspec.boundary_posterior(conf).sum(-1), torch.ones(4))


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: dspec.boundary_posterior(torch.rand(5)), "2 dimensions"),
        (lambda: dspec.boundary_posterior(torch.rand(2, 3, 4)), "2 dimensions"),
        (lambda: dspec.boundary_posterior(torch.ones(2, 3, dtype=torch.int64)), "dtype"),
        (lambda: dspec.boundary_posterior(torch.tensor([[0.5, 1.5]])), r"\[0, 1\]"),
        (lambda: dspec.expected_accept_length(torch.tensor([[0.5, -0.1]])), r"\[0, 1\]"),
        (lambda: dspec.rejection_boundaries(torch.tensor([[0.5, float("nan")]]), 1), r"\[0, 1\]"),
        (lambda: dspec.rejection_boundaries(torch.rand(2, 3), 4), "k must be <= L"),
        (lambda: dspec.rejection_boundaries(torch.rand(2, 3), 0), "k must be >= 1"),
    ],
)
def test_bad_input_raises_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_value_checks_can_be_disabled():
    dspec.config.validate_values = False
    try:
        r = dspec.boundary_posterior(torch.tensor([[0.5, float("nan")]]))  # no sync, no error
        assert torch.isnan(r[0, 2])
    finally:
        dspec.config.validate_values = True

import math

import pytest
import torch

import dspec
from conftest import assert_close_nan, device_backends
from dspec.reference.token_stats import token_stats as reference
from logits_cases import key_scan_rows, special_rows

# (dtype, atol, rtol): every backend upcasts to float32, so the tolerance is float32
# accumulation error over V terms, not the logits' precision.
DTYPES = [(torch.float32, 1e-6, 1e-4), (torch.float16, 1e-6, 1e-4), (torch.bfloat16, 1e-6, 1e-4)]


def check(out: dspec.TokenStats, exp: dspec.TokenStats, atol, rtol):
    assert out.token.dtype == torch.int64
    assert torch.equal(out.token.cpu(), exp.token.cpu())
    for name in ("prob", "margin", "entropy", "lse"):
        assert_close_nan(getattr(out, name), getattr(exp, name), rtol=rtol, atol=atol, name=name)


@device_backends()
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (7, 2), (7, 111), (1, 1000), (7, 3001)])
@pytest.mark.parametrize("temperature", [1.0, 1e-4, 1e4])
def test_matches_reference(device, backend, dtype, atol, rtol, rows, vocab, temperature):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = special_rows(torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(device)
    out = dspec.token_stats(x, temperature=temperature, backend=backend)
    check(out, reference(x.cpu(), temperature), atol, rtol)


@device_backends(skip_torch=True)
@pytest.mark.parametrize("vocab", [32000, 151936, 256000])
def test_real_vocab_sizes(device, backend, vocab):
    if backend == "triton" and device == "cpu" and vocab > 32000:
        pytest.skip("interpreter: large V covered by the split tests at smaller sizes")
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(2, vocab, generator=g) * 3).to(torch.bfloat16).to(device)
    check(dspec.token_stats(x, backend=backend), reference(x.cpu()), 1e-6, 1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [37, 1000, 49152])
def test_cpp_reads_bf16_as_its_float32_widening(temperature, vocab):
    """The C++ CPU kernel widens bf16 rows exactly: the argmax and lse of bf16 logits are
    those of the same values in float32, bit for bit (ties and large spreads included).  The
    decoders rely on it: ``ar`` scores the model's bf16 logits while ``diffusion`` widens its
    block first, and the self-speculative engine scores the bf16 rows it picks."""
    from dspec import _backend

    if not _backend.cpp_available():
        pytest.skip("dspec._C not built")
    g = torch.Generator().manual_seed(vocab)
    for scale in (1.0, 5.0, 30.0):
        x = (torch.randn(24, vocab, generator=g) * scale).to(torch.bfloat16)
        x[3, 5] = x[3, 9] = x[3].max()  # a tie: the lower id
        a = dspec.token_stats(x, temperature=temperature, backend="cpp")
        b = dspec.token_stats(x.float(), temperature=temperature, backend="cpp")
        assert torch.equal(a.token, b.token) and torch.equal(a.lse, b.lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 1000, 49157])
def test_cpp_key_scan_edge_cases(dtype, vocab):
    from dspec import _backend

    if not _backend.cpp_available():
        pytest.skip("dspec._C not built")
    x = key_scan_rows(vocab, dtype)
    assert x[2].float().isnan().sum() == 1 and torch.signbit(x[2].float()).all()
    out = dspec.token_stats(x, backend="cpp")
    check(out, reference(x), 1e-6, 1e-4)
    assert out.token.tolist()[:2] == [3, 2] and out.token[2].item() == -1


@device_backends(skip_torch=True)
def test_leading_shape_and_strides(device, backend):
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 150, generator=g).to(device)
    x = wide[..., 10:120]  # rows not contiguous with each other
    out = dspec.token_stats(x, temperature=0.7, backend=backend)
    assert out.token.shape == (2, 3)
    check(out, reference(x.cpu(), 0.7), 1e-6, 1e-4)
    xt = torch.randn(40, 5, generator=g).to(device).t()  # unit stride is not along V
    check(dspec.token_stats(xt, backend=backend), reference(xt.cpu()), 1e-6, 1e-4)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_triton_vocab_split(splits):
    """The split-vocabulary path (used for small batches on a GPU) merges exactly."""
    pytest.importorskip("triton")
    from conftest import backends_for

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in [b for _, b in backends_for(device)]:
        pytest.skip("no triton backend here")
    from dspec.kernels.token_stats import token_stats_triton

    g = torch.Generator().manual_seed(splits)
    x = special_rows(torch.randn(7, 2000, generator=g) * 3).to(device)
    x[6, 1999] = x[6, 0] = 100.0  # tie across splits: the lower id wins
    out = dspec.TokenStats(*token_stats_triton(x, 0.5, num_splits=splits, block=128))
    check(out, reference(x.cpu(), 0.5), 1e-6, 1e-4)
    assert out.token[6].item() == 0


def test_reference_against_float64_definitions():
    """The reference itself against textbook formulas in float64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 333, generator=g, dtype=torch.float64) * 3
    for t in (0.3, 1.0, 5.0):
        p = torch.softmax(x / t, -1)
        top = p.topk(2, -1).values
        out = reference(x.float(), t)
        assert torch.equal(out.token, x.argmax(-1))
        torch.testing.assert_close(out.prob.double(), top[:, 0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out.margin.double(), top[:, 0] - top[:, 1], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out.entropy.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.lse.double(), torch.logsumexp(x / t, -1), rtol=1e-6, atol=1e-6)


def test_semantics_small_cases():
    s = dspec.token_stats(torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]]))
    assert s.token.tolist() == [1, 0]
    assert s.margin.tolist() == [0.0, 0.0]
    assert math.isclose(s.entropy[1].item(), math.log(3), rel_tol=1e-6)
    one = dspec.token_stats(torch.tensor([[7.0]]))
    assert (one.token.item(), one.prob.item(), one.margin.item(), one.entropy.item()) == (0, 1.0, 1.0, 0.0)
    # tiny temperature: no overflow, the argmax takes all the mass
    cold = dspec.token_stats(torch.tensor([[1.0, 2.0]]), temperature=1e-30)
    assert cold.prob.item() == 1.0 and cold.lse.item() == pytest.approx(2e30, rel=1e-6)


def test_invalid_rows_documented_outcome():
    x = torch.tensor([[0.0, float("nan")], [float("-inf"), float("-inf")], [0.0, float("inf")]])
    s = dspec.token_stats(x, backend="torch")
    assert s.token.tolist() == [-1, -1, -1]
    assert torch.isnan(s.prob).all() and torch.isnan(s.entropy).all() and torch.isnan(s.margin).all()
    assert math.isnan(s.lse[0].item()) and s.lse[1].item() == float("-inf") and s.lse[2].item() == float("inf")


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: dspec.token_stats(torch.zeros(3, 0)), "empty vocabulary"),
        (lambda: dspec.token_stats(torch.zeros(())), "at least 1 dimension"),
        (lambda: dspec.token_stats(torch.zeros(3, 4, dtype=torch.int64)), "dtype"),
        (lambda: dspec.token_stats([[1.0, 2.0]]), "torch.Tensor"),
        (lambda: dspec.token_stats(torch.zeros(3, 4), temperature=0.0), "temperature"),
        (lambda: dspec.token_stats(torch.zeros(3, 4), temperature=float("inf")), "temperature"),
        (lambda: dspec.token_stats(torch.zeros(3, 4), temperature=-1), "temperature"),
        (lambda: dspec.token_stats(torch.zeros(3, 4), backend="cuda"), "cuda"),
        (lambda: dspec.token_stats(torch.zeros(3, 4), backend="metal"), "backend must be one of"),
    ],
)
def test_bad_input_raises_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@device_backends()
def test_extreme_magnitudes(device, backend):
    """(x - max) / T overflowing to -inf must not turn the entropy into NaN."""
    x = torch.tensor([[3e38, -3e38, 0.0, 1e38], [1.0, 2.0, 3.0, -1e30]], device=device)
    for t in (1.0, 1e-30, 1e30):
        check(dspec.token_stats(x, temperature=t, backend=backend), reference(x.cpu(), t), 1e-6, 1e-4)

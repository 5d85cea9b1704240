"""Backend selection: the backend= argument, $DSPEC_BACKEND, and "auto"."""

import subprocess
import sys

import pytest
import torch

import dspec
from dspec import _backend


def test_auto_on_cpu_prefers_cpp_then_torch():
    expected = "cpp" if _backend.cpp_available() else "torch"
    assert _backend.resolve("token_stats", None, torch.device("cpu"), ("torch", "triton", "cuda", "cpp")) == expected
    assert _backend.resolve("topk_tokens", None, torch.device("cpu"), ("torch", "triton")) == "torch"


def test_auto_on_cuda_order(monkeypatch):
    monkeypatch.setattr(_backend, "backend_ready", lambda name: name in ("torch", "triton"))
    assert _backend.resolve("op", "auto", torch.device("cuda"), ("torch", "triton", "cuda")) == "triton"
    monkeypatch.setattr(_backend, "backend_ready", lambda name: True)
    assert _backend.resolve("op", "auto", torch.device("cuda"), ("torch", "triton", "cuda")) == "cuda"
    assert _backend.resolve("op", "auto", torch.device("cuda"), ("torch",)) == "torch"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("DSPEC_BACKEND", "torch")
    assert _backend.resolve("op", None, torch.device("cpu"), ("torch", "cpp")) == "torch"
    monkeypatch.setenv("DSPEC_BACKEND", "bogus")
    with pytest.raises(ValueError, match="DSPEC_BACKEND|backend must be one of"):
        dspec.token_stats(torch.zeros(2, 3))
    # the argument wins over the environment
    assert dspec.token_stats(torch.zeros(2, 3), backend="torch").token.tolist() == [0, 0]


def test_environment_variable_is_a_preference(monkeypatch):
    """$DSPEC_BACKEND names a backend the call may not be able to use: it falls back to
    auto (an explicit backend= stays strict)."""
    cpu = torch.device("cpu")
    auto = _backend.resolve("op", None, cpu, ("torch", "triton", "cuda", "cpp"))
    monkeypatch.setenv("DSPEC_BACKEND", "cuda")  # CPU tensors
    assert _backend.resolve("op", None, cpu, ("torch", "triton", "cuda", "cpp")) == auto
    with pytest.raises(ValueError, match="needs CUDA tensors|not available"):
        _backend.resolve("op", "cuda", cpu, ("torch", "cuda"))
    monkeypatch.setenv("DSPEC_BACKEND", "cpp")
    assert _backend.resolve("op", None, cpu, ("torch", "triton")) == "torch"  # op without C++ code
    monkeypatch.setenv("DSPEC_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _backend.resolve("op", None, cpu, ("torch", "triton")) == "torch"


def test_generate_under_every_backend_preference(monkeypatch):
    model = dspec.load("tiny-ar")
    want = dspec.generate(model, "Compute: 1 + 2 =", method="ar", max_new_tokens=4).tokens
    for name in ("cpp", "cuda", "torch"):
        monkeypatch.setenv("DSPEC_BACKEND", name)
        assert dspec.generate(model, "Compute: 1 + 2 =", method="ar", max_new_tokens=4).tokens == want


def test_errors_name_the_problem(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="no 'cuda' backend"):
        _backend.resolve("topk_tokens", "cuda", cpu, ("torch", "triton"))
    monkeypatch.setattr(_backend, "backend_ready", lambda name: True)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _backend.resolve("op", "cuda", cpu, ("torch", "cuda"))
    with pytest.raises(ValueError, match="needs CPU tensors"):
        _backend.resolve("op", "cpp", torch.device("cuda"), ("torch", "cpp"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _backend.resolve("op", "triton", cpu, ("torch", "triton"))


def test_import_needs_no_gpu_nor_triton():
    """`import dspec` must not import triton (kernels load lazily) nor initialise CUDA."""
    code = (
        "import sys, dspec, torch; dspec.token_stats(torch.zeros(2, 3)); "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_broadcast_rows_are_accepted(backend):
    """An ``expand``ed logits tensor (rows with stride 0) is read like its copy."""
    if backend == "cpp":
        pytest.importorskip("dspec._C")
    row = torch.randn(1, 1, 37)
    for logits in (row.expand(1, 3, 37), row.expand(4, 3, 37)):
        drafts = torch.zeros(logits.shape[0], 2, dtype=torch.int64)
        got = dspec.verify_chain(drafts, logits, backend=backend)
        want = dspec.verify_chain(drafts, logits.contiguous(), backend="torch")
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(
            dspec.token_stats(logits, backend=backend).token,
            dspec.token_stats(logits.contiguous(), backend="torch").token,
        )

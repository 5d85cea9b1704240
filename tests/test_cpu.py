"""dspec.cpu: dtype choice by CPU capability, the thread policy, the machine record."""

import pytest
import torch

from dspec import cpu


@pytest.fixture
def flags(monkeypatch):
    def set_flags(*names):
        monkeypatch.setattr(cpu, "cpuinfo", lambda: ("test cpu", frozenset(names)))

    return set_flags


@pytest.mark.parametrize(
    "names, level, expected",
    [
        (("avx2", "avx512f"), "generic", torch.float32),
        (("avx2", "avx512f"), "avx2", torch.bfloat16),  # dspec's AVX2 tiles widen bf16
        (("avx2", "avx512f", "avx512_bf16"), "generic", torch.bfloat16),
        (("avx512f", "amx_tile", "amx_bf16"), "amx", torch.bfloat16),
        ((), "generic", torch.float32),
        ((), None, torch.float32),  # no extension
    ],
)
def test_default_dtype_follows_native_bf16_and_dspec_tiles(flags, monkeypatch, names, level, expected):
    monkeypatch.delenv("DSPEC_DTYPE", raising=False)
    flags(*names)
    monkeypatch.setattr(cpu, "isa", lambda: level)
    assert cpu.native_bf16() == any(n in names for n in ("avx512_bf16", "amx_bf16"))
    assert cpu.default_dtype("cpu") == expected
    assert cpu.default_dtype("cuda") is None


def test_dtype_env_overrides(flags, monkeypatch):
    flags("amx_bf16")
    monkeypatch.setenv("DSPEC_DTYPE", "float32")
    assert cpu.default_dtype() == torch.float32
    monkeypatch.setenv("DSPEC_DTYPE", "fp8")
    with pytest.raises(ValueError, match="DSPEC_DTYPE"):
        cpu.default_dtype()
    monkeypatch.setenv("DSPEC_DTYPE", "auto")
    assert cpu.default_dtype() == torch.bfloat16


def test_default_dtype_bad_device():
    with pytest.raises(ValueError, match="device"):
        cpu.default_dtype("gpu0")


def test_load_uses_default_dtype(flags, monkeypatch, tmp_path):
    import dspec
    from tiny_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path, "llama", seed=0)
    monkeypatch.delenv("DSPEC_DTYPE", raising=False)
    flags("avx512_bf16")
    assert dspec.load(path).dtype == torch.bfloat16
    assert dspec.load(path, dtype="float32").dtype == torch.float32
    assert dspec.load("tiny-ar").dtype == torch.float32  # pinned: see hub.SHIPPED_DTYPES
    flags("avx2")
    monkeypatch.setattr(cpu, "isa", lambda: "generic")  # no dspec SIMD tiles: fp32
    assert dspec.load(path).dtype == torch.float32
    monkeypatch.setattr(cpu, "isa", lambda: "avx2")
    assert dspec.load(path).dtype == torch.bfloat16


def test_threads_env_and_auto(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("DSPEC_NUM_THREADS", "1")
        assert cpu.default_threads() == 1
        assert cpu.apply_threads() == 1 and torch.get_num_threads() == 1
        assert cpu.apply_threads(2) == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("DSPEC_NUM_THREADS", "auto")
        monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.05: 0.0)
        assert cpu.default_threads() == cpu.cores()
        monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.05: cpu.cores() + 3.0)
        assert cpu.default_threads() == 1  # never below one
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv("DSPEC_NUM_THREADS", bad)
            with pytest.raises(ValueError, match="DSPEC_NUM_THREADS"):
                cpu.default_threads()
        for bad in (0, -2, "x", True):
            with pytest.raises(ValueError, match="threads"):
                cpu.apply_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_busy_cores_sample():
    busy = cpu.busy_cores(0.02)
    assert busy is None or 0.0 <= busy <= (__import__("os").cpu_count() or 1)


def test_machine_record():
    m = cpu.machine()
    assert {"cpu_model", "cpu_flags", "native_bf16", "cores", "torch_threads", "loadavg"} <= set(m)
    assert set(m["cpu_flags"]) <= set(cpu.REPORTED_FLAGS)


def _scoped_torch_threads() -> int:
    """torch's threads inside torch_ops_one_thread with 2 outside: 1, except at the generic
    level, where torch's ops run the forward and keep their threads."""
    return 2 if cpu.isa() in (None, "generic") else 1


def test_torch_ops_one_thread_scope_nests_and_restores():
    before = torch.get_num_threads()
    inside = _scoped_torch_threads()
    try:
        torch.set_num_threads(2)
        assert cpu.kernel_threads() == 2
        with cpu.torch_ops_one_thread():
            assert torch.get_num_threads() == inside and cpu.kernel_threads() == 2
            with cpu.torch_ops_one_thread():
                assert torch.get_num_threads() == inside and cpu.kernel_threads() == 2
            assert torch.get_num_threads() == inside  # the outer scope still holds
        assert torch.get_num_threads() == 2 and cpu.kernel_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with cpu.torch_ops_one_thread():
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored on an exception
    finally:
        torch.set_num_threads(before)


def test_torch_keeps_its_threads_in_the_scope_at_the_generic_level():
    """At the generic level the scope leaves torch's threads (its GEMMs run the projections)
    and dspec's per-layer kernels run on one thread (layer_threads)."""
    if cpu.isa() is None:
        pytest.skip("needs dspec._C")
    before = torch.get_num_threads()
    prev = cpu.set_isa_cap("generic")
    try:
        torch.set_num_threads(2)
        assert cpu.layer_threads() == 1
        with cpu.torch_ops_one_thread():
            assert torch.get_num_threads() == 2 and cpu.kernel_threads() == 2
    finally:
        cpu.set_isa_cap(prev)
        torch.set_num_threads(before)
    if cpu.isa() != "generic":
        assert cpu.layer_threads() == cpu.kernel_threads()


def test_generate_decodes_in_the_scope_and_restores_threads():
    import gc

    import dspec
    from dspec.decode import ar

    before = torch.get_num_threads()
    seen = {}
    real = ar.decode

    def spy(*args, **kwargs):
        seen["torch"], seen["kernels"] = torch.get_num_threads(), cpu.kernel_threads()
        seen["gc"] = gc.isenabled()
        return real(*args, **kwargs)

    try:
        torch.set_num_threads(2)
        model = dspec.load("tiny-ar")
        ar.decode = spy
        dspec.generate(model, [1, 2, 3], method="ar", max_new_tokens=2)
        assert seen == {"torch": _scoped_torch_threads(), "kernels": 2, "gc": False}
        assert torch.get_num_threads() == 2 and gc.isenabled()
    finally:
        ar.decode = real
        torch.set_num_threads(before)

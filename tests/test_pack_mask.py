"""pack_mask / unpack_mask: the bit layout, every backend against the reference and an
independent bit-by-bit oracle, odd shapes and strides, argument checks (wrapper and _C)."""

import pytest
import torch

import dspec
from conftest import device_backends
from dspec import _backend
from dspec.reference.pack_mask import pack_mask as ref_pack, unpack_mask as ref_unpack


def oracle_pack(mask: torch.Tensor) -> torch.Tensor:
    """Bit by bit in Python ints: bit j of word w is key 32 w + j."""
    rows = mask.reshape(-1, mask.shape[-1]).tolist()
    num_words = (mask.shape[-1] + 31) // 32
    out = []
    for row in rows:
        words = []
        for w in range(num_words):
            v = sum(1 << j for j in range(32) if 32 * w + j < len(row) and row[32 * w + j])
            words.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(words)
    return torch.tensor(out, dtype=torch.int32).reshape(*mask.shape[:-1], num_words)


def random_mask(shape, seed, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) < p


SHAPES = [(1, 1), (3, 31), (5, 32), (7, 33), (2, 3, 63), (4, 64), (3, 100), (2, 257)]


@device_backends()
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pack_matches_oracle_and_round_trips(device, backend, shape):
    for seed, p in ((0, 0.5), (1, 0.05), (2, 0.95)):
        m = random_mask(shape, seed, p).to(device)
        words = dspec.pack_mask(m, backend=backend)
        assert words.dtype == torch.int32 and words.device == m.device
        assert words.shape == (*shape[:-1], (shape[-1] + 31) // 32)
        assert torch.equal(words.cpu(), oracle_pack(m.cpu()))
        back = dspec.unpack_mask(words, shape[-1], backend=backend)
        assert back.dtype == torch.bool and torch.equal(back.cpu(), m.cpu())


@device_backends()
def test_bit_layout(device, backend):
    def pack(cols, keys):
        m = torch.zeros(1, keys, dtype=torch.bool)
        m[0, cols] = True
        return dspec.pack_mask(m.to(device), backend=backend).cpu()[0].tolist()

    assert pack([0], 1) == [1]
    assert pack([1, 3], 4) == [10]
    assert pack([31], 32) == [-(2**31)]  # bit 31 is the sign bit
    assert pack(list(range(32)), 32) == [-1]
    assert pack([32], 33) == [0, 1]
    assert pack(list(range(33)), 33) == [-1, 1]  # bits past K stay 0
    assert pack([5, 64 + 31], 96) == [32, 0, -(2**31)]
    words = torch.tensor([[-1, 1]], dtype=torch.int32, device=device)
    assert dspec.unpack_mask(words, 33, backend=backend).cpu().tolist() == [[True] * 33]
    # trailing bits past num_keys are ignored
    assert dspec.unpack_mask(words, 3, backend=backend).cpu().tolist() == [[True] * 3]
    assert dspec.unpack_mask(words[:, :1], 32, backend=backend).all()


@device_backends()
def test_strided_and_empty_inputs(device, backend):
    m = random_mask((40, 70), 3).to(device)
    t = m.t()  # [70, 40]: unit stride along rows, not keys
    assert torch.equal(dspec.pack_mask(t, backend=backend).cpu(), oracle_pack(t.cpu()))
    s = m[::3, 5:60]  # row stride 210, offset start
    assert torch.equal(dspec.pack_mask(s, backend=backend).cpu(), oracle_pack(s.cpu()))
    w = ref_pack(random_mask((6, 90), 4)).to(device)
    ws = w[::2]  # strided words rows
    assert torch.equal(dspec.unpack_mask(ws, 90, backend=backend).cpu(), ref_unpack(ws.cpu(), 90))
    wt = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32).to(device).t()  # [5, 3], stride 1 along rows
    assert torch.equal(dspec.unpack_mask(wt, 96, backend=backend).cpu(), ref_unpack(wt.cpu(), 96))
    empty_k = torch.zeros(4, 0, dtype=torch.bool, device=device)
    assert dspec.pack_mask(empty_k, backend=backend).shape == (4, 0)
    empty_q = torch.zeros(2, 0, 40, dtype=torch.bool, device=device)
    assert dspec.pack_mask(empty_q, backend=backend).shape == (2, 0, 2)
    assert dspec.unpack_mask(torch.zeros(4, 0, dtype=torch.int32, device=device), 0, backend=backend).shape == (4, 0)
    assert dspec.unpack_mask(torch.zeros(4, 2, dtype=torch.int32, device=device), 0, backend=backend).shape == (4, 0)
    one_d = random_mask((45,), 5).to(device)
    assert torch.equal(dspec.pack_mask(one_d, backend=backend).cpu(), oracle_pack(one_d.cpu()))


@device_backends(skip_torch=True)
def test_larger_masks_match_reference(device, backend):
    shape = (3, 40, 300) if backend == "triton" and device == "cpu" else (4, 300, 1000)
    m = random_mask(shape, 6).to(device)
    words = dspec.pack_mask(m, backend=backend)
    assert torch.equal(words.cpu(), ref_pack(m.cpu()))
    assert torch.equal(dspec.unpack_mask(words, shape[-1], backend=backend).cpu(), m.cpu())


def test_reference_matches_oracle():
    for shape in SHAPES:
        m = random_mask(shape, 7)
        assert torch.equal(ref_pack(m), oracle_pack(m))
        assert torch.equal(ref_unpack(ref_pack(m), shape[-1]), m)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="mask must have dtype"):
        dspec.pack_mask(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mask must be a torch.Tensor"):
        dspec.pack_mask([[True]])
    with pytest.raises(ValueError, match="mask must have at least 1"):
        dspec.pack_mask(torch.tensor(True))
    words = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="words must have dtype"):
        dspec.unpack_mask(words.long(), 3)
    with pytest.raises(ValueError, match="num_keys"):
        dspec.unpack_mask(words, 65)
    with pytest.raises(ValueError, match="num_keys"):
        dspec.unpack_mask(words, -1)
    with pytest.raises(ValueError, match="num_keys must be an int"):
        dspec.unpack_mask(words, True)
    with pytest.raises(ValueError, match="num_keys must be an int"):
        dspec.unpack_mask(words, 3.0)
    with pytest.raises(ValueError, match="backend"):
        dspec.pack_mask(torch.zeros(2, 3, dtype=torch.bool), backend="bogus")


# ------------------------------------------------------------------------------------------
# dspec._C directly

needs_ext = pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C is not built")


@needs_ext
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(mask_ptr=0), "mask_ptr"),
        (dict(words_ptr=0), "words_ptr"),
        (dict(words_ptr=2), "words_ptr"),  # misaligned, filled in below
        (dict(rows=-1), "rows"),
        (dict(num_keys=-2), "num_keys"),
        (dict(row_stride=10), "row_stride"),
        (dict(row_stride=-1), "row_stride"),
        (dict(device="gpu"), "device"),
    ],
)
def test_ext_pack_rejects_bad_arguments_before_writing(bad, match):
    ext = _backend.extension()
    m = random_mask((3, 40), 8)
    out = torch.full((3, 2), 77, dtype=torch.int32)
    kwargs = dict(
        mask_ptr=m.data_ptr(), rows=3, num_keys=40, row_stride=40, words_ptr=out.data_ptr(), device="cpu", stream=0
    )
    kwargs.update(bad)
    if match == "words_ptr" and bad["words_ptr"] == 2:
        kwargs["words_ptr"] = out.data_ptr() + 2
    with pytest.raises(ValueError, match=match):
        ext.pack_mask(**kwargs)
    assert bool((out == 77).all())


@needs_ext
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(words_ptr=0), "words_ptr"),
        (dict(out_ptr=0), "out_ptr"),
        (dict(num_keys=65), "num_keys"),
        (dict(num_words=-1), "num_words"),
        (dict(row_stride=1), "row_stride"),
        (dict(device=""), "device"),
    ],
)
def test_ext_unpack_rejects_bad_arguments_before_writing(bad, match):
    ext = _backend.extension()
    w = torch.full((3, 2), -1, dtype=torch.int32)
    out = torch.zeros(3, 40, dtype=torch.bool)
    kwargs = dict(
        words_ptr=w.data_ptr(),
        rows=3,
        num_words=2,
        row_stride=2,
        num_keys=40,
        out_ptr=out.data_ptr(),
        device="cpu",
        stream=0,
    )
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        ext.unpack_mask(**kwargs)
    assert not bool(out.any())
    ext.unpack_mask(w.data_ptr(), 3, 2, 2, 40, out.data_ptr(), "cpu")
    assert bool(out.all())


@needs_ext
@pytest.mark.skipif(_backend.cuda_available(), reason="built with CUDA")
def test_ext_cuda_device_without_cuda_build():
    m = torch.zeros(1, 4, dtype=torch.bool)
    out = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="built without CUDA"):
        _backend.extension().pack_mask(m.data_ptr(), 1, 4, 4, out.data_ptr(), "cuda")


# ------------------------------------------------------------------------------------------
# the CUDA kernels (csrc/pack_mask.cu) in the host simulator of tests/cuda_sim

from masks_sim import sim_pack, sim_unpack  # noqa: E402  (the masks_sim fixture: conftest.py)


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (3, 31), (5, 32), (7, 33), (4, 64), (3, 100), (2, 257), (9, 1000)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_cuda_kernels_in_simulator(masks_sim, shape):
    m = random_mask(shape, 11)
    words = sim_pack(masks_sim, m)
    assert torch.equal(words, oracle_pack(m))
    assert torch.equal(sim_unpack(masks_sim, words, shape[-1]), m)
    if shape[-1] > 3:
        assert torch.equal(sim_unpack(masks_sim, words, 3), m[:, :3])  # later bits ignored


def test_cuda_kernels_in_simulator_strides_and_grid_stride(masks_sim):
    m = random_mask((30, 80), 12)
    s = m[::4, 7:70]  # row stride 320, odd start
    assert torch.equal(sim_pack(masks_sim, s), oracle_pack(s))
    w = ref_pack(m)
    assert torch.equal(sim_unpack(masks_sim, w[::3], 80), m[::3])
    # the simulator build caps the grid at 3 blocks (24 warps, 768 threads): the grid-stride
    # loops take several trips
    big = random_mask((50, 130), 13)
    assert torch.equal(sim_pack(masks_sim, big), ref_pack(big))
    assert torch.equal(sim_unpack(masks_sim, ref_pack(big), 130), big)

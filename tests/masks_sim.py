"""The CUDA kernels of csrc/pack_mask.cu and csrc/tree_mask.cu run by the host simulator of
tests/cuda_sim (no GPU needed): a session fixture that builds them and Python callers.

conftest.py registers this module as a plugin: every test module can take the fixture.
"""

import ctypes
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIM_DIR = ROOT / "tests" / "cuda_sim"


@pytest.fixture(scope="session")
def masks_sim(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")) or cxx is None:
        pytest.skip("the CUDA simulator needs Linux (x86-64 / aarch64) and a C++17 compiler")
    lib_path = tmp_path_factory.mktemp("masks_sim") / "libmasks_sim.so"
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-U_FORTIFY_SOURCE",
        "-w",
        "-fPIC",
        "-shared",
        "-pthread",
        f"-I{ROOT / 'csrc'}",
        f"-I{SIM_DIR}",
        str(SIM_DIR / "masks_sim.cpp"),
        "-o",
        str(lib_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    i64, vp, i, s = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    lib.dspec_sim_pack_mask.argtypes = [vp, i64, i64, i64, vp, s, i]
    lib.dspec_sim_unpack_mask.argtypes = [vp, i64, i64, i64, i64, vp, s, i]
    lib.dspec_sim_tree_mask.argtypes = [vp, i, i64, i64, i64, vp, vp, s, i]
    return lib


def _check(rc, err):
    assert rc == 0, err.value.decode()


def sim_pack(lib, mask: torch.Tensor) -> torch.Tensor:
    """mask bool [rows, K] (unit stride along K) -> int32 [rows, ceil(K / 32)]."""
    rows, keys = mask.shape
    out = torch.full((rows, (keys + 31) // 32), 12345, dtype=torch.int32)
    err = ctypes.create_string_buffer(512)
    _check(lib.dspec_sim_pack_mask(mask.data_ptr(), rows, keys, mask.stride(0), out.data_ptr(), err, 512), err)
    return out


def sim_unpack(lib, words: torch.Tensor, num_keys: int) -> torch.Tensor:
    rows, num_words = words.shape
    out = torch.full((rows, num_keys), 7, dtype=torch.uint8)
    err = ctypes.create_string_buffer(512)
    _check(
        lib.dspec_sim_unpack_mask(
            words.data_ptr(), rows, num_words, words.stride(0), num_keys, out.data_ptr(), err, 512
        ),
        err,
    )
    assert bool((out <= 1).all())
    return out.bool()


def sim_tree(lib, parents: torch.Tensor):
    batch, nodes = parents.shape
    words = torch.full((batch, nodes, (nodes + 31) // 32), 12345, dtype=torch.int32)
    depth = torch.full((batch, nodes), -9, dtype=torch.int64)
    err = ctypes.create_string_buffer(512)
    code = {torch.int32: 0, torch.int64: 1}[parents.dtype]
    _check(
        lib.dspec_sim_tree_mask(
            parents.data_ptr(), code, batch, nodes, parents.stride(0), words.data_ptr(), depth.data_ptr(), err, 512
        ),
        err,
    )
    return words, depth

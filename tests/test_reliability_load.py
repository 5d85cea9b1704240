"""The public entry points (dspec.load, dspec.generate's arguments, load_drafter) and the
checkpoint loaders under hostile input: a ValueError (or the documented FileNotFoundError)
naming the argument, file or config key, raised before any work -- never another exception
type, a hang or a huge allocation.  Checkpoints are the tiny random ones of
tests/tiny_checkpoints.py, edited per test; what could hang runs in a subprocess with a
timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dspec
from dspec.models import load_checkpoint
from dspec.models.dflash import BlockDrafter, load_drafter
from tiny_checkpoints import write_checkpoint

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada", "llada")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, file: str = "config.json", **changes) -> Path:
    raw = json.loads((path / file).read_text())
    raw.update(changes)
    (path / file).write_text(json.dumps(raw))
    return path


def _run(code: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (one thread, address space capped at 8 GiB so a huge
    allocation fails fast instead of taking the machine)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO) + os.pathsep + str(REPO / "tests"),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        DSPEC_NUM_THREADS="1",
    )
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------- config sizes


@pytest.mark.parametrize("layers", [10**9, 10**7, 1000, 3])
def test_layer_count_is_bounded_by_the_weights_before_any_table(llama, tmp_path, layers):
    path = _edit(_copy(llama, tmp_path / "c"), num_hidden_layers=layers)
    result = _run(f"""
        import dspec, time
        t = time.perf_counter()
        try:
            dspec.load({str(path)!r})
        except ValueError as e:
            print("VALUEERROR", e)
        print("SECONDS", time.perf_counter() - t)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "VALUEERROR" in result.stdout and "num_hidden_layers" in result.stdout, result.stdout
    assert float(result.stdout.rsplit("SECONDS", 1)[1]) < 10
    if layers > 1024:
        assert "largest size dspec accepts (1024)" in result.stdout
    else:
        assert "the weights hold 2 layers" in result.stdout


def test_llada_layer_count_is_bounded_by_the_weights(llada, tmp_path):
    path = _edit(_copy(llada, tmp_path / "c"), n_layers=1000)
    with pytest.raises(ValueError, match="n_layers = 1000, but the weights hold 2 layers"):
        dspec.load(path)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("vocab_size", 10**9, "vocab_size = 1000000000 is above the largest size dspec accepts"),
        (
            "vocab_size",
            4096,
            r"vocab_size gives a vocabulary of 4096, but model.embed_tokens.weight has shape \[160, 64\]",
        ),
        ("hidden_size", 10**6, "hidden_size = 1000000 is above"),
        ("hidden_size", 128, "hidden_size gives a hidden size of 128"),
        ("num_attention_heads", 10**5, "num_attention_heads = 100000 is above"),
        ({"num_attention_heads": 8, "head_dim": 16}, None, "num_attention_heads x head_dim gives query rows 128"),
        ({"num_key_value_heads": 4}, None, "num_key_value_heads x head_dim gives key rows 64"),
        ("intermediate_size", 10**8, "intermediate_size = 100000000 is above"),
        ("intermediate_size", 4096, "intermediate_size gives an MLP width of 4096"),
        ("max_position_embeddings", 10**12, "max_position_embeddings = 1000000000000 is above"),
        ("max_position_embeddings", 0, "max_position_embeddings must be >= 1, got 0"),
        ("head_dim", 10**7, "head_dim = 10000000 is above"),
    ],
)
def test_config_sizes_are_bounded(llama, tmp_path, key, value, match):
    changes = key if isinstance(key, dict) else {key: value}
    path = _edit(_copy(llama, tmp_path / "c"), **changes)
    with pytest.raises(ValueError, match=match):
        dspec.load(path)


def test_block_size_is_bounded_by_the_context(tmp_path):
    path = write_checkpoint(tmp_path / "sdar", "sdar")
    _edit(path, block_size=10**6)
    with pytest.raises(ValueError, match="block_size = 1000000 is larger than the context"):
        dspec.load(path)


# ------------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("eos_token_id", "</s>", "config.json.*eos_token_id must be an integer token id"),
        ("eos_token_id", [2, "x"], "config.json.*eos_token_id must be an integer token id"),
        ("bos_token_id", {"id": 1}, "config.json.*bos_token_id must be an integer token id"),
        ("pad_token_id", "pad", "config.json.*pad_token_id must be an integer token id"),
        ("eos_token_id", 10**6, r"eos_token_id 1000000 is outside the vocabulary \[0, 160\)"),
        ("eos_token_id", -1, "eos_token_id -1 is outside the vocabulary"),
        ("mask_token_id", "[MASK]", "mask_token_id must be an integer"),
        ("rms_norm_eps", "small", "rms_norm_eps must be a finite positive number"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite positive number"),
        ("rope_theta", [1], "rope_theta must be a finite positive number"),
        ("rope_theta", float("inf"), "rope_theta must be a finite positive number"),
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
        ("hidden_size", float("inf"), "hidden_size must be an integer"),
        ("hidden_size", float("nan"), "hidden_size must be an integer"),
        ("hidden_size", "64", "hidden_size must be an integer"),
        ("num_hidden_layers", -3, "num_hidden_layers must be >= 1"),
        ("architectures", 5, "architectures must be a list of class names"),
        ("rope_scaling", {"rope_type": "linear", "factor": None}, "rope_scaling.factor must be a finite positive"),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": "8k",
            },
            "original_max_position_embeddings must be an integer",
        ),
    ],
)
def test_config_values_name_the_file_and_key(llama, tmp_path, key, value, match):
    path = _edit(_copy(llama, tmp_path / "c"), **{key: value})
    with pytest.raises(ValueError, match=match):
        dspec.load(path)


def test_generation_config_values_name_the_file(llama, tmp_path):
    path = _copy(llama, tmp_path / "c")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="generation_config.json.*eos_token_id must be an integer"):
        dspec.load(path)
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json must hold a JSON object"):
        dspec.load(path)


@pytest.mark.parametrize(
    "content, match",
    [
        ("[]", "tokenizer_config.json: must hold a JSON object, got list"),
        ('"x"', "tokenizer_config.json: must hold a JSON object, got str"),
        (b"\xff\xfe\x00\x81binary", "tokenizer_config.json: not valid JSON .not UTF-8 text"),
        ("[" * 100000, "tokenizer_config.json: not valid JSON"),
    ],
)
def test_tokenizer_config_must_be_a_json_object(llama, tmp_path, content, match):
    path = _copy(llama, tmp_path / "c")
    file = path / "tokenizer_config.json"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match):
        dspec.load(path)


def test_binary_config_json_names_the_file(llama, tmp_path):
    path = _copy(llama, tmp_path / "c")
    (path / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        dspec.load(path)


def test_tokenizer_eos_outside_the_vocabulary(tmp_path):
    wide = write_checkpoint(tmp_path / "wide", "llama", vocab=160)  # a 64-token tokenizer
    path = write_checkpoint(tmp_path / "c", "llama", vocab=40)
    shutil.copy(wide / "tokenizer.json", path / "tokenizer.json")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("eos_token_id")
    (path / "config.json").write_text(json.dumps(raw))
    _edit(path, "tokenizer_config.json", eos_token="w50")  # id 53
    with pytest.raises(
        ValueError,
        match=r"tokenizer_config.json: eos_token 'w50' has id 53, outside the model's "
        r"vocabulary \[0, 40\)",
    ):
        dspec.load(path)


# ------------------------------------------------------------------- files


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "config.json", "tokenizer_config.json", "generation_config.json", "shard-00001.safetensors"],
)
def test_fifos_are_refused_without_blocking(llama, tmp_path, name):
    path = _copy(llama, tmp_path / "c")
    if name == "shard-00001.safetensors":
        (path / "model.safetensors").rename(path / "shard-00000.safetensors")
    elif (path / name).exists():
        (path / name).unlink()
    os.mkfifo(path / name)
    result = _run(
        f"""
        import dspec
        try:
            dspec.load({str(path)!r})
        except ValueError as e:
            print("VALUEERROR", e)
    """,
        timeout=60,
    )
    assert "VALUEERROR" in result.stdout and "not a regular file" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", ""])
def test_weight_map_stays_inside_the_checkpoint(llama, tmp_path, target):
    path = _copy(llama, tmp_path / "c")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(path / "model.safetensors", outside)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": target, "model.embed_tokens.weight": "model.safetensors"}})
    )
    with pytest.raises(ValueError, match="outside the checkpoint directory|non-empty string"):
        dspec.load(path)


@pytest.mark.parametrize("weight_map", [{"a": ["model.safetensors"]}, {"a": None}, {"a": 3}, [], "x"])
def test_weight_map_values_must_be_file_names(llama, tmp_path, weight_map):
    path = _copy(llama, tmp_path / "c")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="weight_map"):
        dspec.load(path)


def test_sharded_checkpoint_inside_the_directory_still_loads(tmp_path):
    path = write_checkpoint(tmp_path / "c", "llama", shards=2)
    assert dspec.load(path).config.num_layers == 2


# ------------------------------------------------------------------- dspec.load arguments


@pytest.mark.parametrize("bad", [123, None, 1.5, b"tiny-ar", ["tiny-ar"], "", "   "])
def test_load_rejects_what_is_not_a_name_or_path(bad):
    with pytest.raises(ValueError, match="name_or_path"):
        dspec.load(bad)


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "gpu0", 3.5])
def test_load_rejects_meta_and_non_devices(device):
    with pytest.raises(ValueError, match="device"):
        dspec.load("tiny-ar", device=device)


def test_load_checkpoint_rejects_meta(llama):
    with pytest.raises(ValueError, match="device='meta'"):
        load_checkpoint(llama, device="meta")


# ------------------------------------------------------------------- generate arguments


@pytest.mark.parametrize("model", ["tiny-ar", None, 42, Path("tiny-ar")])
def test_generate_needs_a_loaded_model(model):
    with pytest.raises(ValueError, match="model must be"):
        dspec.generate(model, "hi", method="ar", max_new_tokens=4)


def test_generate_says_to_load_a_named_model():
    with pytest.raises(ValueError, match=r"dspec.load\('tiny-ar'\)"):
        dspec.generate("tiny-ar", "hi", method="ar", max_new_tokens=4)


def test_generate_refuses_meta_weights(ar):
    from dspec.models.transformer import Model

    meta = Model(ar.config, tokenizer=ar.tokenizer, _meta=True)
    with pytest.raises(ValueError, match="model: its weights are on the meta device"):
        dspec.generate(meta, "hi", method="ar", max_new_tokens=4)


@pytest.mark.parametrize("method", ["dflash", "d2sd"])
def test_block_drafter_argument_types(ar, bd, method):
    for drafter, match in (
        (42, "drafter must be a BlockDrafter.*got int"),
        (bd, "drafter must be a BlockDrafter.*got Model.*diffuspec"),
        (3.5, "drafter must be a BlockDrafter"),
        (b"tiny-ar-dflash", "drafter must be a BlockDrafter"),
        ("no-such-drafter", "neither a directory nor a shipped drafter"),
    ):
        with pytest.raises(ValueError, match=match):
            dspec.generate(ar, "hi", method=method, max_new_tokens=4, drafter=drafter)


def test_load_drafter_argument_types(ar, bd):
    with pytest.raises(ValueError, match="drafter must be a BlockDrafter.*got NoneType"):
        load_drafter(None, ar)
    with pytest.raises(ValueError, match="got Model.*diffuspec"):
        load_drafter(bd, ar)
    meta = BlockDrafter.for_target(ar, block_size=4).to("meta")
    with pytest.raises(ValueError, match="meta device"):
        load_drafter(meta, ar)


def test_diffuspec_drafter_must_be_a_dllm(ar):
    with pytest.raises(
        ValueError,
        match=r"drafter: method 'diffuspec' drafts with a block-diffusion model.*"
        r"'tiny-ar-dflash'.*a block drafter",
    ):
        dspec.generate(ar, "hi", method="diffuspec", max_new_tokens=4, drafter="tiny-ar-dflash")
    for bad in (42, b"tiny-bd", BlockDrafter.for_target(ar, block_size=4)):
        with pytest.raises(ValueError, match="drafter: method 'diffuspec' drafts with"):
            dspec.generate(ar, "hi", method="diffuspec", max_new_tokens=4, drafter=bad)


def test_diffuspec_bogus_ngram_names_the_option(ar):
    with pytest.raises(ValueError, match="ngram: no n-gram file at 'bogus'.*ngram= takes an NgramLM"):
        dspec.generate(ar, "hi", method="diffuspec", max_new_tokens=4, ngram="bogus")


@pytest.mark.parametrize("seed", [2**64, -1, 10**30, 1.0, "1", True])
def test_seed_bounds(ar, seed):
    with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*64 - 1\]"):
        dspec.generate(ar, "hi", method="ar", max_new_tokens=2, temperature=1.0, seed=seed)


def test_largest_seed_samples(ar):
    a = dspec.generate(ar, "hi", method="ar", max_new_tokens=3, temperature=1.0, seed=2**64 - 1)
    b = dspec.generate(ar, "hi", method="ar", max_new_tokens=3, temperature=1.0, seed=2**64 - 1)
    assert a.tokens == b.tokens


@pytest.mark.parametrize(
    "prompt", [b"def f():", bytearray(b"def f():"), memoryview(b"ab"), [b"def f():", b"x"], ["ok", b"x"]]
)
def test_bytes_prompts_are_refused(ar, prompt):
    with pytest.raises(ValueError, match=r"prompt(\[\d\])?: bytes are not a prompt"):
        dspec.generate(ar, prompt, method="ar", max_new_tokens=2)


@pytest.mark.parametrize(
    "prompt", [{1: 2}, {1, 2}, 7, None, 1.5, [True, False], iter([1, 2]), [[1, 2], 3], [[1, 2], None], [[1, 2], [1.5]]]
)
def test_other_prompt_types_are_refused(ar, prompt):
    with pytest.raises(ValueError, match="prompt"):
        dspec.generate(ar, prompt, method="ar", max_new_tokens=2)


def test_prompt_forms_agree(ar):
    import numpy as np

    ids = ar.tokenizer.encode("def f(x):")
    one = dspec.generate(ar, ids, method="ar", max_new_tokens=3).tokens
    assert dspec.generate(ar, tuple(ids), method="ar", max_new_tokens=3).tokens == one
    assert dspec.generate(ar, np.array(ids), method="ar", max_new_tokens=3).tokens == one
    batch = dspec.generate(ar, ["def f(x):", ids, np.array(ids)], method="ar", max_new_tokens=3)
    assert [g.tokens for g in batch] == [one, one, one]
    assert [g.tokens for g in dspec.generate(ar, np.array([ids, ids]), method="ar", max_new_tokens=3)] == [one, one]
    with pytest.raises(ValueError, match="prompt"):
        dspec.generate(ar, np.array([1.5, 2.5]), method="ar", max_new_tokens=2)


def test_cli_refuses_device_meta():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DSPEC_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspec",
            "generate",
            "--model",
            "tiny-ar",
            "--method",
            "ar",
            "--max-new-tokens",
            "2",
            "--prompt",
            "x",
            "--device",
            "meta",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "meta" in result.stderr, result.stderr[-2000:]


# ------------------------------------------------------------------- drafter checkpoints


@pytest.fixture()
def drafter_dir(ar, tmp_path):
    BlockDrafter.for_target(ar, block_size=4).save(tmp_path / "dr")
    return tmp_path / "dr"


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("num_layers", 10**9, "num_layers = 1000000000 is above"),
        ("num_layers", 50, "num_layers = 50, but the weights hold 1 layers"),
        ("head_dim", 10**9, "head_dim = 1000000000 is above"),
        ("intermediate_size", 10**9, "intermediate_size = 1000000000 is above"),
        ("rope_theta", "x", "rope_theta must be a finite positive number"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite positive number"),
        ("extra", [], "extra must be a dict"),
        ("target_layer_ids", [1] * 10**5, "target_layer_ids"),
    ],
)
def test_drafter_config_is_bounded(ar, drafter_dir, key, value, match):
    _edit(drafter_dir, **{key: value})
    with pytest.raises(ValueError, match=match):
        load_drafter(drafter_dir, ar)


@pytest.mark.parametrize("content", ["[]", b"\xff\xfe\x00binary", "{"])
def test_drafter_config_file_names_the_file(ar, drafter_dir, content):
    (drafter_dir / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match="config.json"):
        load_drafter(drafter_dir, ar)


def test_drafter_fifo_is_refused_without_blocking(ar, drafter_dir):
    (drafter_dir / "model.safetensors").unlink()
    os.mkfifo(drafter_dir / "model.safetensors")
    result = _run(
        f"""
        import dspec
        from dspec.models.dflash import load_drafter
        try:
            load_drafter({str(drafter_dir)!r}, dspec.load("tiny-ar"))
        except ValueError as e:
            print("VALUEERROR", e)
    """,
        timeout=60,
    )
    assert "VALUEERROR" in result.stdout and "not a regular file" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------------- fuzzing

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

LOADER_EXAMPLES = int(os.environ.get("DSPEC_LOADER_FUZZ_EXAMPLES", "60"))
LOADER_FUZZ = settings(
    max_examples=LOADER_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# a JSON value of every kind, the hostile ones weighted in
JSON_VALUES = st.one_of(
    st.sampled_from(
        [
            0,
            -1,
            1,
            2,
            3,
            10**9,
            10**18,
            2**64,
            10**400,
            -(10**12),
            float("nan"),
            float("inf"),
            float("-inf"),
            0.5,
            1e-300,
            1e308,
            True,
            False,
            None,
            "",
            "x",
            "</s>",
            "silu",
            [],
            {},
            [None],
            [1, "x"],
            [10**9],
            {"rope_type": "linear"},
            {"rope_type": "llama3", "factor": "x"},
            {"content": 3},
            {"content": "<eos>"},
            "\x00",
            [[[]]],
        ]
    ),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=10**6), max_size=4),
)
CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "head_dim",
    "hidden_act",
    "architectures",
    "model_type",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "mask_token_id",
    "block_size",
    "bd_size",
    "rope_parameters",
)
LLADA_KEYS = (
    "d_model",
    "n_heads",
    "n_kv_heads",
    "n_layers",
    "mlp_hidden_size",
    "mlp_ratio",
    "vocab_size",
    "embedding_size",
    "max_sequence_length",
    "weight_tying",
    "multi_query_attention",
    "include_qkv_bias",
    "input_emb_norm",
    "scale_logits",
    "block_type",
    "rope",
    "alibi",
    "mask_token_id",
    "eos_token_id",
    "rms_norm_eps",
    "rope_theta",
)
TOKENIZER_KEYS = ("bos_token", "eos_token", "pad_token", "mask_token", "chat_template", "model_max_length")


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return {f: write_checkpoint(root / f, f) for f in ("llama", "qwen3", "sdar", "llada")}


def _load_bounded(path: Path, budget_s: float = 20.0) -> None:
    """dspec.load(path): loads, or raises ValueError / FileNotFoundError, within
    ``budget_s`` and without growing the process by more than 1 GiB."""
    import resource
    import time

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        dspec.load(path)
    except (ValueError, FileNotFoundError):
        pass
    assert time.perf_counter() - start < budget_s
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 20)  # kB


def _write_mutated(base: Path, dst: Path, file: str, changes: dict, drop: list) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base, dst)
    raw = json.loads((dst / file).read_text())
    raw.update(changes)
    for k in drop:
        raw.pop(k, None)
    (dst / file).write_text(json.dumps(raw))
    return dst


@LOADER_FUZZ
@given(st.data())
def test_fuzz_config_values(fuzz_bases, tmp_path_factory, data):
    family = data.draw(st.sampled_from(sorted(fuzz_bases)))
    keys = LLADA_KEYS if family == "llada" else CONFIG_KEYS
    changes = data.draw(st.dictionaries(st.sampled_from(keys), JSON_VALUES, min_size=1, max_size=3))
    drop = data.draw(st.lists(st.sampled_from(keys), max_size=1))
    dst = _write_mutated(
        fuzz_bases[family], tmp_path_factory.getbasetemp() / "fuzz-config", "config.json", changes, drop
    )
    _load_bounded(dst)


@LOADER_FUZZ
@given(st.data())
def test_fuzz_tokenizer_and_generation_config(fuzz_bases, tmp_path_factory, data):
    family = data.draw(st.sampled_from(sorted(fuzz_bases)))
    dst = tmp_path_factory.getbasetemp() / "fuzz-tok"
    if data.draw(st.booleans()):
        changes = data.draw(st.dictionaries(st.sampled_from(TOKENIZER_KEYS), JSON_VALUES, min_size=1, max_size=3))
        _write_mutated(fuzz_bases[family], dst, "tokenizer_config.json", changes, [])
    else:
        _write_mutated(fuzz_bases[family], dst, "config.json", {}, [])
        gen = data.draw(
            st.one_of(
                JSON_VALUES,
                st.dictionaries(
                    st.sampled_from(("eos_token_id", "bos_token_id", "pad_token_id")), JSON_VALUES, max_size=3
                ),
            )
        )
        (dst / "generation_config.json").write_text(json.dumps(gen))
    _load_bounded(dst)


@LOADER_FUZZ
@given(st.data())
def test_fuzz_drafter_config_values(ar, tmp_path_factory, data):
    base = tmp_path_factory.getbasetemp() / "fuzz-drafter-base"
    if not base.exists():
        BlockDrafter.for_target(ar, block_size=4).save(base)
    keys = (
        "kind",
        "hidden_size",
        "vocab_size",
        "target_layer_ids",
        "target_num_layers",
        "block_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "rope_theta",
        "rms_norm_eps",
        "target",
        "extra",
    )
    changes = data.draw(st.dictionaries(st.sampled_from(keys), JSON_VALUES, min_size=1, max_size=3))
    dst = _write_mutated(base, tmp_path_factory.getbasetemp() / "fuzz-drafter", "config.json", changes, [])
    try:
        load_drafter(dst, ar)
    except ValueError:
        pass

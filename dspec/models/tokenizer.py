"""A thin wrapper around a ``tokenizers.Tokenizer`` read from a checkpoint's tokenizer.json, or
built from its vocab.json + merges.txt (the byte-level BPE of GPT-2 / Qwen2-era checkpoints)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """tokenizer.json or vocab.json + merges.txt (via the ``tokenizers`` library) plus
    tokenizer_config.json's specials.

    ``encode(text)`` returns token ids (no special tokens added unless asked);
    ``decode(ids)`` drops special tokens by default.  ``inner`` is the
    ``tokenizers.Tokenizer``; ``chat_template`` is the raw Jinja template string (or None).
    """

    def __init__(self, inner, *, bos_token=None, eos_token=None, pad_token=None, mask_token=None, chat_template=None):
        self.inner = inner
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.mask_token = mask_token
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has none dspec can read.

        tokenizer.json when present; otherwise a byte-level BPE built from vocab.json +
        merges.txt (the GPT-2 / Qwen2 layout, see :func:`byte_level_bpe`) with the added and
        special tokens of tokenizer_config.json, special_tokens_map.json and added_tokens.json.
        ValueError naming the file for one that is not a regular file, not UTF-8 JSON of the
        right shape, a merges.txt line that is not two known tokens, or a merges.txt without
        vocab.json."""
        from ._files import is_regular_file, read_json

        path = Path(path)
        file = path / "tokenizer.json"
        cfg = read_json(path / "tokenizer_config.json", required=False, want=dict)
        if is_regular_file(file):
            from tokenizers import Tokenizer as _HFTokenizer

            try:
                inner = _HFTokenizer.from_file(str(file))
            except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception type)
                raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from None
            specials = _named_specials(cfg or {})
        else:
            has_vocab = is_regular_file(path / "vocab.json")
            has_merges = is_regular_file(path / "merges.txt")
            if has_merges and not has_vocab:
                raise ValueError(
                    f"{path / 'merges.txt'}: a BPE merges file needs {path / 'vocab.json'}, which is missing"
                )
            if not (has_vocab and has_merges):
                return None
            inner, specials = byte_level_bpe(path, cfg)
        return cls(
            inner,
            **{
                k: v
                for k, v in specials.items()
                if k in ("bos_token", "eos_token", "pad_token", "mask_token", "chat_template")
            },
        )

    # -------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(int(token_id))

    def _id(self, token):
        return None if token is None else self.inner.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def mask_token_id(self) -> int | None:
        return self._id(self.mask_token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts, *, add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str, **kwargs) -> list[int]:
        return self.encode(text, **kwargs)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"


# -----------------------------------------------------------------------------------------
# vocab.json + merges.txt: the byte-level BPE of GPT-2 and Qwen2-era checkpoints

# the named special tokens of tokenizer_config.json / special_tokens_map.json, in the order
# transformers adds the ones the vocabulary lacks
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_EXTRA_KEYS = ("additional_special_tokens", "extra_special_tokens")

# Qwen2's pre-tokenization (transformers' Qwen2Tokenizer, tiktoken's cl100k with single
# digits): contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# checkpoints whose tokenizer is Qwen2's (the regex above, NFC) when tokenizer_config.json
# names no tokenizer class: config.json's model_type
_QWEN2_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "dream", "sdar", "fast_dllm_v2")

MAX_MERGES_BYTES = 256 << 20


def _token_content(value):
    """An AddedToken written as a string or as ``{"content": ...}``; None otherwise."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_specials(cfg: dict) -> dict:
    specials = {}
    for key in _SPECIAL_KEYS + ("chat_template",):
        value = _token_content(cfg.get(key))
        if value is not None:
            specials[key] = value
    return specials


def _is_qwen2_style(cfg: dict, root: Path) -> bool:
    """Qwen2's pre-tokenization or GPT-2's: the tokenizer class tokenizer_config.json names
    (Qwen2Tokenizer and its copies such as Dream's), else config.json's model_type."""
    from ._files import read_json

    cls_name = cfg.get("tokenizer_class")
    if isinstance(cls_name, str) and cls_name:
        low = cls_name.lower()
        return "qwen" in low or "dream" in low
    model_cfg = read_json(root / "config.json", required=False, want=dict) or {}
    model_type = model_cfg.get("model_type")
    return isinstance(model_type, str) and model_type.lower() in _QWEN2_MODEL_TYPES


def _read_vocab(file: Path) -> dict:
    from ._files import read_json

    vocab = read_json(file, required=True, want=dict)
    seen = {}
    for token, tid in vocab.items():
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < 2**31:
            raise ValueError(f"{file}: token {token!r:.80} has id {tid!r:.80}; ids must be integers in [0, 2**31)")
        if tid in seen:
            raise ValueError(f"{file}: tokens {seen[tid]!r:.80} and {token!r:.80} share the id {tid}")
        seen[tid] = token
    return vocab


def _read_merges(file: Path, vocab: dict) -> list[tuple[str, str]]:
    """merges.txt: an optional ``#version`` line, then one merge ``left right`` per line in
    rank order; both sides and their concatenation must be vocabulary tokens."""
    import os

    size = os.stat(file).st_size
    if size > MAX_MERGES_BYTES:
        raise ValueError(f"{file}: {size} bytes, larger than a merges.txt can be ({MAX_MERGES_BYTES} bytes)")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot be read ({e.strerror or e})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    merges = []
    for number, line in enumerate(lines, 1):
        line = line.removesuffix("\r")
        if line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(
                f"{file}: line {number} is {line!r:.80}, not a merge 'left right' (two tokens separated by one space)"
            )
        for token in (parts[0], parts[1], parts[0] + parts[1]):
            if token not in vocab:
                raise ValueError(
                    f"{file}: line {number} merges {parts[0]!r:.40} and {parts[1]!r:.40}, "
                    f"but {token!r:.80} is not in vocab.json"
                )
        merges.append((parts[0], parts[1]))
    return merges


def _added_tokens(root: Path, cfg: dict, specials: dict) -> list:
    """The added tokens as ``(id or None, AddedToken)`` in the order transformers adds them:
    tokenizer_config.json's ``added_tokens_decoder`` when it has one, else
    added_tokens.json (special when named as a special token); then every special token
    not among them (its id is then the vocabulary's, or the next free one)."""
    from tokenizers import AddedToken

    from ._files import read_json

    file = root / "tokenizer_config.json"
    out = []
    decoder = cfg.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise ValueError(
                f"{file}: added_tokens_decoder must be an object {{id: token}}, got {type(decoder).__name__}"
            )
        for key, tok in decoder.items():
            if not (isinstance(key, str) and key.isdigit()) or int(key) >= 2**31:
                raise ValueError(f"{file}: added_tokens_decoder key {key!r:.80} is not a token id")
            content = _token_content(tok)
            if not content:
                raise ValueError(f"{file}: added_tokens_decoder[{key}] has no 'content' string")
            flags = {
                k: tok[k]
                for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                if isinstance(tok, dict) and isinstance(tok.get(k), bool)
            }
            out.append((int(key), AddedToken(content, **flags)))
    else:
        names = {v for k, v in specials.items() if k in _SPECIAL_KEYS}
        names.update(specials.get("_extra", ()))
        added_file = root / "added_tokens.json"
        added = read_json(added_file, required=False, want=dict) or {}
        for content, tid in added.items():
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < 2**31:
                raise ValueError(
                    f"{added_file}: token {content!r:.80} has id {tid!r:.80}; ids must be integers in [0, 2**31)"
                )
            special = content in names
            out.append((tid, AddedToken(content, normalized=not special, special=special)))
    out.sort(key=lambda item: item[0])
    present = {tok.content for _, tok in out}
    for content in [specials[k] for k in _SPECIAL_KEYS if k in specials] + list(specials.get("_extra", ())):
        if content not in present:
            present.add(content)
            out.append((None, AddedToken(content, special=True, normalized=False)))
    return out


def byte_level_bpe(root, cfg: dict | None = None):
    """``(tokenizers.Tokenizer, specials)`` from a checkpoint's vocab.json + merges.txt, built
    as transformers builds ``GPT2Tokenizer`` / ``Qwen2Tokenizer`` from them.

    GPT-2: byte-level pre-tokenization with GPT-2's regex (``add_prefix_space`` from
    tokenizer_config.json).  Qwen2 (``tokenizer_class`` naming Qwen2 or Dream, or a Qwen-family
    model_type): NFC, then :data:`QWEN2_PRETOKENIZE_REGEX`, then the byte-level mapping.
    Both decode byte-level.  Special tokens come from tokenizer_config.json (with
    special_tokens_map.json's values when it has no ``added_tokens_decoder``), defaulting as
    the transformers class does (``<|endoftext|>``); added tokens keep their ids.
    ``add_bos_token`` / ``add_eos_token`` become the post-processor of ``add_special_tokens``."""
    from tokenizers import Regex, Tokenizer as _HFTokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    from ._files import read_json

    root = Path(root)
    if cfg is None:
        cfg = read_json(root / "tokenizer_config.json", required=False, want=dict) or {}
    cfg = dict(cfg)
    vocab = _read_vocab(root / "vocab.json")
    merges = _read_merges(root / "merges.txt", vocab)
    qwen2 = _is_qwen2_style(cfg, root)

    if "added_tokens_decoder" not in cfg:  # legacy checkpoints: special_tokens_map.json
        smap_file = root / "special_tokens_map.json"
        smap = read_json(smap_file, required=False, want=dict) or {}
        cfg.update({k: v for k, v in smap.items() if k in _SPECIAL_KEYS + _EXTRA_KEYS})
    defaults = (
        {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
        if qwen2
        else {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    )
    for key, value in defaults.items():
        cfg.setdefault(key, value)
    specials = _named_specials(cfg)
    extra = []
    for key in _EXTRA_KEYS:
        value = cfg.get(key)
        if isinstance(value, list):
            extra += [c for c in map(_token_content, value) if c and c not in extra]
    specials["_extra"] = extra

    added = _added_tokens(root, cfg, specials)
    vocab = dict(vocab)
    owner = {tid: tok for tok, tid in vocab.items()}
    for tid, tok in added:
        if tid is None:
            continue
        if owner.get(tid, tok.content) != tok.content:
            raise ValueError(
                f"{root / 'vocab.json'}: id {tid} is {owner[tid]!r:.80}, but the added token "
                f"{tok.content!r:.80} claims it (tokenizer_config.json / added_tokens.json)"
            )
        if vocab.get(tok.content, tid) != tid:
            raise ValueError(
                f"{root / 'vocab.json'}: {tok.content!r:.80} has id {vocab[tok.content]}, but the "
                f"added tokens give it id {tid} (tokenizer_config.json / added_tokens.json)"
            )
        vocab[tok.content] = tid  # the added token keeps its declared id
        owner[tid] = tok.content

    inner = _HFTokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    add_prefix_space = bool(cfg.get("add_prefix_space") or False)
    if qwen2:
        inner.normalizer = normalizers.NFC()
        inner.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    else:
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    inner.decoder = decoders.ByteLevel()
    for tid, tok in added:
        if tok.special:
            inner.add_special_tokens([tok])
        else:
            inner.add_tokens([tok])

    bos, eos = specials.get("bos_token"), specials.get("eos_token")
    add_bos = bool(cfg.get("add_bos_token")) and bos is not None
    add_eos = bool(cfg.get("add_eos_token")) and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    inner.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(t, inner.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on],
    )
    specials.pop("_extra")
    return inner, specials

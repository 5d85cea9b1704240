"""A thin wrapper around a ``tokenizers.Tokenizer`` read from a checkpoint's tokenizer.json."""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """tokenizer.json (via the ``tokenizers`` library) plus tokenizer_config.json's specials.

    ``encode(text)`` returns token ids (no special tokens added unless asked);
    ``decode(ids)`` drops special tokens by default.  ``inner`` is the
    ``tokenizers.Tokenizer``; ``chat_template`` is the raw Jinja template string (or None).
    """

    def __init__(self, inner, *, bos_token=None, eos_token=None, pad_token=None,
                 mask_token=None, chat_template=None):
        self.inner = inner
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.mask_token = mask_token
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json.
        ValueError naming the file for a tokenizer.json / tokenizer_config.json that is not a
        regular file, not UTF-8 JSON, or (tokenizer_config.json) not a JSON object."""
        from ._files import is_regular_file, read_json
        path = Path(path)
        file = path / "tokenizer.json"
        if not is_regular_file(file):
            return None
        from tokenizers import Tokenizer as _HFTokenizer
        try:
            inner = _HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception type)
            raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from None
        specials = {}
        cfg = read_json(path / "tokenizer_config.json", required=False, want=dict)
        if cfg is not None:
            for key in ("bos_token", "eos_token", "pad_token", "mask_token", "chat_template"):
                value = cfg.get(key)
                if isinstance(value, dict):          # AddedToken serialised as an object
                    value = value.get("content")
                if isinstance(value, str):
                    specials[key] = value
        return cls(inner, **specials)

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

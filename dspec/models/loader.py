"""Load a local Hugging Face checkpoint directory into dspec's lean transformer.

Reads config.json (+ generation_config.json), the safetensors weights (one file, or shards
listed by model.safetensors.index.json) and the tokenizer via the ``tokenizers`` library:
tokenizer.json, or a byte-level BPE built from vocab.json + merges.txt.
No ``trust_remote_code`` and no transformers at runtime: each family's weight names are
mapped onto the lean transformer here.  Every problem (missing config, unknown family,
missing / unexpected weights, wrong shapes) is a ValueError that says what and where.
The config is read first and bounded (types, sizes, ids) and its sizes are checked against
the safetensors headers (names and shapes, no data) before any per-layer table or tensor is
built, so a lying config.json can neither hang the loader nor exhaust memory; only regular
files inside the directory are opened.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._files import inside, is_regular_file, read_json
from .config import FAMILIES, ModelConfig, parse_config
from .tokenizer import Tokenizer
from .transformer import Model

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def load_checkpoint(path, *, device="cpu", dtype=None) -> Model:
    """A local HF checkpoint directory -> ``Model`` (inference mode: ``requires_grad`` off).

    path : directory with config.json, *.safetensors (sharded with
        model.safetensors.index.json or not) and optionally the tokenizer (tokenizer.json, or
        vocab.json + merges.txt as GPT-2 / Qwen2-era checkpoints ship it, with
        tokenizer_config.json / special_tokens_map.json / added_tokens.json) and
        generation_config.json.  Without either tokenizer layout the model loads with
        ``tokenizer=None``.
    device : where the weights go.
    dtype : torch dtype or name ("float32", "bfloat16", "float16"); None / "auto" keeps the
        dtype the weights are stored in.
    """
    device = check_device(device)
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is not a directory")
    raw = _read_json(root / "config.json", required=True)
    gen = _read_json(root / "generation_config.json", required=False)
    cfg = parse_config(raw, gen)  # types and sane bounds (config.LIMITS)
    tensors = _index_weights(root)  # name -> (file, shape, dtype): headers only
    _check_sizes(root, cfg, tensors)  # the config's sizes against the weights' shapes
    tokenizer = Tokenizer.from_dir(root)
    cfg = _resolve_ids(cfg, tokenizer, root)

    mapping = checkpoint_names(cfg)  # canonical -> checkpoint name
    expected = expected_shapes(cfg)
    _check_weights(root, cfg, tensors, mapping, expected)

    first = mapping["embed_tokens.weight"]
    target_dtype = _dtype(dtype, tensors[first][2])
    model = Model(cfg, tokenizer=tokenizer, device=device, dtype=target_dtype, _meta=True)
    state = _read_tensors(root, tensors, mapping, device, target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.name_or_path = str(root)
    return model


# ------------------------------------------------------------------------------ names


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """Canonical parameter name (the lean transformer's) -> the checkpoint's tensor name."""
    out = {}
    llada = cfg.family == "llada"
    for canon in expected_shapes(cfg):
        if not llada:
            out[canon] = canon if canon == "lm_head.weight" else "model." + canon
            continue
        out[canon] = _llada_name(canon)
    return out


_LLADA_LAYER = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def _llada_name(canon: str) -> str:
    top = {
        "embed_tokens.weight": "model.transformer.wte.weight",
        "norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight",
    }
    if canon in top:
        return top[canon]
    _, i, rest = canon.split(".", 2)  # layers.{i}.<module>.<weight|bias>
    module, leaf = rest.rsplit(".", 1)
    return f"model.transformer.blocks.{i}.{_LLADA_LAYER[module]}.{leaf}"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the lean transformer for ``cfg`` and its shape."""
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, hq * d)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (inter,)
            shapes[p + "mlp.up_proj.bias"] = (inter,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    shapes["norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if cfg.tie_word_embeddings and name in ("lm_head.weight", "model.transformer.ff_out.weight"):
        return True
    return False


# ------------------------------------------------------------------------------ files


def _read_json(file: Path, *, required: bool):
    return read_json(
        file, required=required, missing=f"{file.parent}: no {file.name} (not a Hugging Face checkpoint directory?)"
    )


def check_device(device) -> torch.device:
    """``device`` as a torch.device a model can decode on: ValueError naming ``device`` for
    what is not a device, a CUDA device on a machine without one, or the meta device (its
    tensors hold no data: every forward would fail inside its first kernel)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r:.80}") from None
    if dev.type == "meta":
        raise ValueError("device='meta' holds no data to decode with: load the model on 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: this machine has no CUDA device (torch.cuda.is_available() is False); use device='cpu'"
        )
    return dev


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if is_regular_file(index):
        data = _read_json(index, required=True)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: has no weight_map")
        bad = next((v for v in weight_map.values() if not isinstance(v, str)), None)
        if bad is not None:
            raise ValueError(f"{index}: weight_map values must be shard file names, got {bad!r:.80}")
        files = [inside(root, f) for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not is_regular_file(f)]
        if missing:
            raise ValueError(f"{root}: shards listed in {index.name} are missing: {missing[:5]}")
        return files
    single = root / "model.safetensors"
    if is_regular_file(single):
        return [single]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        other = [p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {other[:3]}: only safetensors are read)" if other else ""
        raise ValueError(f"{root}: no *.safetensors weights{hint}")
    for f in files:
        is_regular_file(f)  # ValueError for a FIFO / device / directory
    return files


def _index_weights(root: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Every tensor's file, shape and dtype, from the safetensors headers alone (no data read)."""
    from safetensors import safe_open

    out = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = (file, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # noqa: BLE001  (safetensors raises SafetensorError / OSError)
            raise ValueError(f"{file}: cannot read safetensors ({e})") from None
    return out


# the config.json keys each size comes from, per weight layout
_KEYS = {
    "hf": {
        "num_layers": "num_hidden_layers",
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "intermediate_size": "intermediate_size",
    },
    "llada": {
        "num_layers": "n_layers",
        "vocab_size": "embedding_size / vocab_size",
        "hidden_size": "d_model",
        "num_heads": "n_heads",
        "num_kv_heads": "n_kv_heads",
        "intermediate_size": "mlp_hidden_size",
    },
}


def _check_sizes(root: Path, cfg: ModelConfig, tensors: dict) -> None:
    """The config's sizes against the weights' actual shapes, before any per-layer table is
    built: the layer count against the distinct layers the weights hold, the vocabulary and
    hidden size against the embedding, the heads and MLP width against layer 0.  ValueError
    naming the config key; weights that are absent are reported by ``_check_weights``."""
    llada = cfg.family == "llada"
    keys = _KEYS["llada" if llada else "hf"]
    where = f"{root}: config.json ({cfg.family})"
    prefix = "model.transformer.blocks." if llada else "model.layers."
    layers = {name[len(prefix) :].split(".", 1)[0] for name in tensors if name.startswith(prefix)}
    if cfg.num_layers > len(layers):
        raise ValueError(f"{where}: {keys['num_layers']} = {cfg.num_layers}, but the weights hold {len(layers)} layers")

    def shape(canon):
        name = _llada_name(canon) if llada else ("model." + canon)
        got = tensors.get(name)
        return (name, got[1]) if got is not None and len(got[1]) == 2 else (None, None)

    def check(canon, dim, want, key, what):
        name, got = shape(canon)
        if name is not None and got[dim] != want:
            raise ValueError(f"{where}: {key} gives {what} {want}, but {name} has shape {list(got)}")

    d = cfg.head_dim
    check("embed_tokens.weight", 0, cfg.vocab_size, keys["vocab_size"], "a vocabulary of")
    check("embed_tokens.weight", 1, cfg.hidden_size, keys["hidden_size"], "a hidden size of")
    check("layers.0.self_attn.q_proj.weight", 0, cfg.num_heads * d, f"{keys['num_heads']} x head_dim", "query rows")
    check("layers.0.self_attn.k_proj.weight", 0, cfg.num_kv_heads * d, f"{keys['num_kv_heads']} x head_dim", "key rows")
    check("layers.0.mlp.gate_proj.weight", 0, cfg.intermediate_size, keys["intermediate_size"], "an MLP width of")


def _check_weights(root, cfg, tensors, mapping, expected) -> None:
    missing = [mapping[c] for c in expected if mapping[c] not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{root}: checkpoint ({cfg.family}) is missing weights: {missing[:5]}{more}")
    bad = []
    for canon, shape in expected.items():
        got = tensors[mapping[canon]][1]
        if got != shape:
            bad.append(f"{mapping[canon]}: expected {list(shape)}, got {list(got)}")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"{root}: weights with the wrong shape for its config.json ({cfg.family}): {'; '.join(bad[:5])}{more}"
        )
    used = set(mapping.values())
    extra = sorted(n for n in tensors if n not in used and not _ignorable(n, cfg))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(
            f"{root}: unexpected weights for a {cfg.family} model as its config.json "
            f"describes it: {extra[:5]}{more} (a different architecture or config?)"
        )
    for name in used:
        if tensors[name][2] not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(
                f"{root}: weight {name} has dtype {tensors[name][2]}; expected a float "
                f"(quantized checkpoints are not supported)"
            )


def _read_tensors(root, tensors, mapping, device, dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for canon, name in mapping.items():
        by_file.setdefault(tensors[name][0], []).append(canon)
    state = {}
    for file, canons in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for canon in canons:
                state[canon] = f.get_tensor(mapping[canon]).to(device=device, dtype=dtype)
    return state


def _dtype(dtype, stored: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float32}.get(
            stored, torch.float32
        )
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.lower().replace("torch.", "")]
    raise ValueError(f"dtype must be None, 'auto', a torch float dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def _resolve_ids(cfg: ModelConfig, tokenizer: Tokenizer | None, root: Path) -> ModelConfig:
    """mask_token_id (config.json, else the tokenizer's mask token, else the family's id) and
    EOS/BOS from the tokenizer when config.json lacks them."""
    fam = FAMILIES[cfg.family]
    changes = {}
    if fam.mask_token_id is None:
        changes["mask_token_id"] = None  # causal LMs have no [MASK]
    else:
        mask = cfg.mask_token_id
        if mask is None and tokenizer is not None:
            for tok in ((tokenizer.mask_token,) if tokenizer.mask_token else ()) + fam.mask_tokens:
                mask = tokenizer.token_to_id(tok)
                if mask is not None:
                    break
        if mask is None:
            mask = fam.mask_token_id
        if not 0 <= mask < cfg.vocab_size:
            raise ValueError(
                f"{root}: mask token id {mask} ({cfg.family}) is outside the vocabulary "
                f"[0, {cfg.vocab_size}); set mask_token_id in config.json"
            )
        changes["mask_token_id"] = int(mask)
    if tokenizer is not None:
        for key, field, token, tid in (
            ("eos_token_ids", "eos_token", tokenizer.eos_token, tokenizer.eos_token_id),
            ("bos_token_id", "bos_token", tokenizer.bos_token, tokenizer.bos_token_id),
        ):
            if tid is None or getattr(cfg, key) not in ((), None):
                continue
            if not 0 <= tid < cfg.vocab_size:
                raise ValueError(
                    f"{root / 'tokenizer_config.json'}: {field} {token!r} has id {tid}, outside the "
                    f"model's vocabulary [0, {cfg.vocab_size})"
                )
            changes[key] = (tid,) if key == "eos_token_ids" else tid
    return cfg.replace(**changes)

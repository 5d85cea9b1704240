"""Tiny random checkpoints in each family's exact config keys and weight names.

``write_checkpoint(path, family, ...)`` writes config.json, safetensors weights (one file or
shards + model.safetensors.index.json) and a tiny WordLevel tokenizer.json made with the
``tokenizers`` library.  The weight names are spelled out here, independently of
``dspec.models.loader``'s mapping, from each family's own modeling code:

- Llama / Qwen2 / Qwen3 / Dream / SDAR / Fast-dLLM v2: ``model.embed_tokens``,
  ``model.layers.N.self_attn.{q,k,v,o}_proj`` (+ q/k/v bias for Qwen2-based,
  ``q_norm``/``k_norm`` for Qwen3-based), ``model.layers.N.mlp.{gate,up,down}_proj``,
  ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``;
- LLaDA (modeling_llada.py, LLaDALlamaBlock): ``model.transformer.wte``,
  ``model.transformer.blocks.N.{q_proj,k_proj,v_proj,attn_out,ff_proj,up_proj,ff_out,
  attn_norm,ff_norm}``, ``model.transformer.ln_f``, ``model.transformer.ff_out``;
  its MLP is ``ff_out(silu(ff_proj(x)) * up_proj(x))``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "llada", "dream", "sdar", "fast_dllm_v2")
MASK_TOKEN = {"llada": "<|mdm_mask|>", "dream": "<|mask|>", "sdar": "<|MASK|>", "fast_dllm_v2": "|<MASK>|"}
SPECIALS = ["<unk>", "<bos>", "<eos>"]  # ids 0, 1, 2; a family's mask token is id 3
BASE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llada": "llada",
    "dream": "qwen2",
    "sdar": "qwen3",
    "fast_dllm_v2": "qwen2",
}


def write_tokenizer(path: Path, vocab_size: int, mask_token: str | None = None) -> list[str]:
    """A WordLevel tokenizer over words w0, w1, ... (whitespace split) with specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = SPECIALS + ([mask_token] if mask_token else [])
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if mask_token:
        cfg["mask_token"] = mask_token
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return specials + words


def family_config(
    family: str,
    *,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    inter=96,
    vocab=160,
    head_dim=None,
    tie=False,
    block_size=4,
    rope_theta=10000.0,
) -> dict:
    """config.json as the family's real checkpoints spell it."""
    if family == "llada":
        return {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "auto_map": {
                "AutoConfig": "configuration_llada.LLaDAConfig",
                "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            },
            "d_model": hidden,
            "n_heads": heads,
            "n_kv_heads": kv_heads,
            "n_layers": layers,
            "mlp_hidden_size": inter,
            "mlp_ratio": 4,
            "vocab_size": vocab,
            "embedding_size": vocab,
            "max_sequence_length": 256,
            "rope_theta": rope_theta,
            "rms_norm_eps": 1e-5,
            "mask_token_id": 3,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "weight_tying": tie,
            "include_bias": False,
            "include_qkv_bias": False,
            "block_type": "llama",
            "activation_type": "silu",
            "layer_norm_type": "rms",
            "rope": True,
            "alibi": False,
            "attention_layer_norm": False,
            "scale_logits": False,
            "input_emb_norm": False,
            "use_cache": False,
            "torch_dtype": "float32",
        }
    base = BASE[family]
    cfg = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
    }
    if base == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if base in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if base == "qwen3":
        cfg.update(head_dim=head_dim or 32, attention_bias=False)
    elif head_dim:
        cfg["head_dim"] = head_dim
    cfg.update(
        {
            "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
            "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
            "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
            "dream": {
                "architectures": ["DreamModel"],
                "model_type": "Dream",
                "mask_token_id": 3,
                "pad_token_id": 2,
                "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
            },
            "sdar": {
                "architectures": ["SDARForCausalLM"],
                "model_type": "sdar",
                "block_size": block_size,
                "auto_map": {
                    "AutoConfig": "configuration_sdar.SDARConfig",
                    "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
                },
            },
            "fast_dllm_v2": {
                "architectures": ["Fast_dLLM_QwenForCausalLM"],
                "model_type": "Fast_dLLM_Qwen",
                "bd_size": block_size,
                "auto_map": {
                    "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                    "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
                },
            },
        }[family]
    )
    return cfg


def family_weights(family: str, cfg: dict, *, seed=0, std=0.2) -> dict[str, torch.Tensor]:
    """Random weights under the family's own tensor names."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + rnd(n, scale=0.1)

    out = {}
    if family == "llada":
        h, nh, kvh = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
        inter, v = cfg["mlp_hidden_size"], cfg["embedding_size"]
        d = h // nh
        p = "model.transformer."
        out[p + "wte.weight"] = rnd(v, h, scale=1.0)
        for i in range(cfg["n_layers"]):
            b = f"{p}blocks.{i}."
            out[b + "attn_norm.weight"] = norm(h)
            out[b + "ff_norm.weight"] = norm(h)
            out[b + "q_proj.weight"] = rnd(nh * d, h)
            out[b + "k_proj.weight"] = rnd(kvh * d, h)
            out[b + "v_proj.weight"] = rnd(kvh * d, h)
            out[b + "attn_out.weight"] = rnd(h, nh * d)
            out[b + "ff_proj.weight"] = rnd(inter, h)
            out[b + "up_proj.weight"] = rnd(inter, h)
            out[b + "ff_out.weight"] = rnd(h, inter)
        out[p + "ln_f.weight"] = norm(h)
        if not cfg["weight_tying"]:
            out[p + "ff_out.weight"] = rnd(v, h)
        return out
    base = BASE[family]
    h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, v = cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // nh
    out["model.embed_tokens.weight"] = rnd(v, h, scale=1.0)
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        out[b + "input_layernorm.weight"] = norm(h)
        out[b + "post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", nh * d), ("k_proj", kvh * d), ("v_proj", kvh * d)):
            out[b + f"self_attn.{name}.weight"] = rnd(rows, h)
            if base == "qwen2":
                out[b + f"self_attn.{name}.bias"] = rnd(rows, scale=0.1)
        out[b + "self_attn.o_proj.weight"] = rnd(h, nh * d)
        if base == "qwen3":
            out[b + "self_attn.q_norm.weight"] = norm(d)
            out[b + "self_attn.k_norm.weight"] = norm(d)
        out[b + "mlp.gate_proj.weight"] = rnd(inter, h)
        out[b + "mlp.up_proj.weight"] = rnd(inter, h)
        out[b + "mlp.down_proj.weight"] = rnd(h, inter)
    out["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = rnd(v, h)
    return out


def save_weights(path: Path, weights: dict[str, torch.Tensor], *, shards: int = 1) -> None:
    from safetensors.torch import save_file

    names = sorted(weights)
    if shards <= 1:
        save_file(
            {k: weights[k].contiguous() for k in names}, str(path / "model.safetensors"), metadata={"format": "pt"}
        )
        return
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k].contiguous() for k in part}, str(path / file), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = file
            total += weights[k].numel() * weights[k].element_size()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def write_checkpoint(
    path,
    family: str,
    *,
    tokenizer: bool = True,
    shards: int = 1,
    seed: int = 0,
    config_overrides: dict | None = None,
    weights_hook=None,
    **shape,
) -> Path:
    """A tiny random checkpoint of ``family`` in ``path``; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = family_config(family, **shape)
    if config_overrides:
        cfg.update(config_overrides)
    weights = family_weights(family, cfg, seed=seed)
    if weights_hook is not None:
        weights = weights_hook(weights) or weights
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_weights(path, weights, shards=shards)
    if tokenizer:
        vocab = cfg.get("embedding_size") or cfg["vocab_size"]
        write_tokenizer(path, min(vocab, 64), MASK_TOKEN.get(family))
    return path


def llada_to_llama(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LLaDA's tensor names -> transformers' Llama names (the same computation)."""
    rename = {
        "attn_norm": "input_layernorm",
        "ff_norm": "post_attention_layernorm",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "ff_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "ff_out": "mlp.down_proj",
    }
    out = {}
    for name, t in weights.items():
        if name == "model.transformer.wte.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "model.transformer.ln_f.weight":
            out["model.norm.weight"] = t
        elif name == "model.transformer.ff_out.weight":
            out["lm_head.weight"] = t
        else:
            _, _, _, i, module, leaf = name.split(".")
            out[f"model.layers.{i}.{rename[module]}.{leaf}"] = t
    return out


def trained_looking_mask_adapter(base, *, mask_token_id: int, rank: int = 4, block_size: int = 4, seed: int = 0):
    """``base`` with a mask-selective adapter whose update is not zero (lora_B and the [MASK]
    embedding drawn from ``seed``), as a trained one is: tests of the adapted paths."""
    from dspec.train.mask_adapter import mask_diffusion_model

    model = mask_diffusion_model(base, block_size=block_size, mask_token_id=mask_token_id, rank=rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        model.mask_adapter.mask_embedding.add_(torch.randn(model.mask_adapter.mask_embedding.shape, generator=g))
    return model

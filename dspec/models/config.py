"""Model configuration: family detection and a small normalised config parsed from config.json.

Families and what differs between them (everything else is the same lean transformer:
RMSNorm, RoPE, GQA, SwiGLU):

=============  ==============================  ==============  ==========  =====  =========
family         architectures / model_type       weights         attention   shift  mask id
=============  ==============================  ==============  ==========  =====  =========
llama          LlamaForCausalLM / llama         HF Llama        causal      no     -
qwen2          Qwen2ForCausalLM / qwen2         + qkv bias      causal      no     -
qwen3          Qwen3ForCausalLM / qwen3         + q/k RMSNorm   causal      no     -
llada          LLaDAModelLM / llada             LLaDA names     bidirect.   no     126336
dream          DreamModel / Dream               Qwen2           bidirect.   yes    151666
sdar           SDARForCausalLM / sdar           Qwen3           block       no     151669
fast_dllm_v2   Fast_dLLM_QwenForCausalLM        Qwen2           block       yes    151665
=============  ==============================  ==============  ==========  =====  =========

``shifted`` (Dream-style right-shifted logits): the logits at suffix position i predict
the token at position i + 1, as in an autoregressive model, also for [MASK] positions;
an unshifted ("position-aligned") diffusion model predicts the token at position i itself.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    base: str               # weight layout: "llama", "qwen2", "qwen3" or "llada"
    attention: str          # one of ATTENTION_KINDS
    shifted: bool
    mask_token_id: int | None
    mask_tokens: tuple[str, ...] = ()     # tokenizer strings tried for the mask id
    block_size: int | None = None         # default for block_causal families


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), ("llama",), "llama", "causal", False, None),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", "causal", False, None),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", "causal", False, None),
    Family("llada", ("LLaDAModelLM",), ("llada",), "llada", "bidirectional", False, 126336,
           ("<|mdm_mask|>",)),
    Family("dream", ("DreamModel",), ("dream",), "qwen2", "bidirectional", True, 151666,
           ("<|mask|>",)),
    Family("sdar", ("SDARForCausalLM",), ("sdar",), "qwen3", "block_causal", False, 151669,
           ("<|MASK|>", "<|mask|>"), 4),
    Family("fast_dllm_v2", ("Fast_dLLM_QwenForCausalLM",), ("fast_dllm_qwen",), "qwen2",
           "block_causal", True, 151665, ("|<MASK>|",), 32),
)}


@dataclass(frozen=True)
class ModelConfig:
    """What the lean transformer needs, normalised across families.

    ``vocab_size`` is the number of logits (the embedding rows; LLaDA's ``embedding_size``).
    ``rope_scaling`` is None or a dict with ``rope_type`` in ("linear", "llama3").
    ``eos_token_ids`` holds every id that ends a generation (config.json and
    generation_config.json together); ``eos_token_id`` is the first of them.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    attention: str
    shifted: bool
    rope_scaling: dict | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    embed_scale: float = 1.0     # LLaDA input_emb_norm: embeddings * sqrt(d_model)
    logit_scale: float = 1.0     # LLaDA scale_logits: logits / sqrt(d_model)
    clean_causal: bool = False   # non-[MASK] queries see keys at positions <= theirs (mask_adapter)
    architecture: str = ""
    model_type: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------


def detect_family(raw: dict) -> Family:
    """The family of a parsed config.json, from ``architectures`` then ``model_type``."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    model_type = str(raw.get("model_type") or "").lower()
    for arch in archs:
        for fam in FAMILIES.values():
            if arch in fam.architectures:
                return fam
    if model_type:
        for fam in FAMILIES.values():
            if model_type in fam.model_types:
                return fam
    supported = ", ".join(f"{f.name} ({f.architectures[0]})" for f in FAMILIES.values())
    raise ValueError(f"unknown model family: config.json has architectures={archs!r}, "
                     f"model_type={raw.get('model_type')!r}; supported: {supported}")


def _get(raw: dict, key: str, default=None, *, required: bool = False, family: str = ""):
    if key in raw and raw[key] is not None:
        return raw[key]
    if required:
        raise ValueError(f"config.json ({family}) is missing the required key {key!r}")
    return default


def _int(raw, key, family, default=None, required=True) -> int:
    value = _get(raw, key, default, required=required and default is None, family=family)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 0:
        raise ValueError(f"config.json ({family}): {key} must be a non-negative integer, got {value!r}")
    return int(value)


def _positive(raw, key, family, default=None) -> int:
    value = _int(raw, key, family, default)
    if value < 1:
        raise ValueError(f"config.json ({family}): {key} must be >= 1, got {value}")
    return value


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value if v is not None)
    return (int(value),)


def _rope(raw: dict, family: str) -> tuple[float, dict | None]:
    """rope_theta and a supported rope_scaling, from the pre-v5 keys (rope_theta,
    rope_scaling) or transformers 5's ``rope_parameters``."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    theta = float(theta if theta is not None else 10000.0)
    if not (theta > 0 and math.isfinite(theta)):
        raise ValueError(f"config.json ({family}): rope_theta must be positive, got {theta}")
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json ({family}): rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        try:
            out = {"rope_type": "llama3", "factor": float(scaling["factor"]),
                   "low_freq_factor": float(scaling["low_freq_factor"]),
                   "high_freq_factor": float(scaling["high_freq_factor"]),
                   "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
        except KeyError as e:
            raise ValueError(f"config.json ({family}): llama3 rope_scaling lacks {e.args[0]!r}") from None
        return theta, out
    raise ValueError(f"config.json ({family}): rope_scaling type {kind!r} is not supported "
                     f"(supported: default, linear, llama3)")


def parse_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    """Normalise a config.json (and optional generation_config.json) into a ModelConfig."""
    fam = detect_family(raw)
    name = fam.name
    archs = raw.get("architectures") or [""]
    common = dict(family=name, attention=fam.attention, shifted=fam.shifted,
                  architecture=str(archs[0] if isinstance(archs, list) else archs),
                  model_type=str(raw.get("model_type") or ""), raw=dict(raw))
    if fam.base == "llada":
        cfg = _parse_llada(raw, name, common)
    else:
        cfg = _parse_hf(raw, fam, name, common)

    eos = _ids(raw.get("eos_token_id"))
    if generation_config:
        eos = eos + tuple(i for i in _ids(generation_config.get("eos_token_id")) if i not in eos)
    bos = raw.get("bos_token_id")
    if bos is None and generation_config:
        bos = generation_config.get("bos_token_id")
    bos = _ids(bos)
    pad = _ids(raw.get("pad_token_id"))
    mask = raw.get("mask_token_id")
    block = None
    if fam.attention == "block_causal":
        block = _int(raw, "block_size", name, required=False)
        if block is None:
            block = _int(raw, "bd_size", name, default=fam.block_size)
        if block < 1:
            raise ValueError(f"config.json ({name}): block_size must be >= 1, got {block}")
    cfg = cfg.replace(eos_token_ids=eos, bos_token_id=bos[0] if bos else None,
                      pad_token_id=pad[0] if pad else None, block_size=block,
                      mask_token_id=None if mask is None else int(mask))
    _check_consistency(cfg)
    return cfg


def _parse_hf(raw, fam: Family, name: str, common: dict) -> ModelConfig:
    hidden = _positive(raw, "hidden_size", name)
    heads = _positive(raw, "num_attention_heads", name)
    kv_heads = _positive(raw, "num_key_value_heads", name, default=heads)
    head_dim = _get(raw, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config.json ({name}): hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads} and head_dim is not given")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    act = _get(raw, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json ({name}): hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if raw.get("use_sliding_window"):
        raise ValueError(f"config.json ({name}): use_sliding_window=true is not supported")
    theta, scaling = _rope(raw, name)
    attn_bias = bool(raw.get("attention_bias", False))
    if fam.base == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attn_bias
    return ModelConfig(
        vocab_size=_positive(raw, "vocab_size", name), hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", name), num_layers=_positive(raw, "num_hidden_layers", name),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", name, required=False),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(raw.get("mlp_bias", False)) if fam.base == "llama" else False,
        qk_norm=fam.base == "qwen3", **common)


def _parse_llada(raw, name: str, common: dict) -> ModelConfig:
    """LLaDA's OLMo-style config (d_model, n_layers, n_heads, mlp_hidden_size, ...)."""
    hidden = _positive(raw, "d_model", name)
    heads = _positive(raw, "n_heads", name)
    kv = raw.get("n_kv_heads")
    if kv is None:
        kv = 1 if raw.get("multi_query_attention") else heads
    kv_heads = int(kv)
    if hidden % heads:
        raise ValueError(f"config.json ({name}): d_model {hidden} is not a multiple of n_heads {heads}")
    mlp = raw.get("mlp_hidden_size")
    if mlp is None:
        mlp = int(_get(raw, "mlp_ratio", 4)) * hidden
    vocab = _positive(raw, "vocab_size", name)
    emb = raw.get("embedding_size") or vocab
    unsupported = []
    if _get(raw, "block_type", "llama") != "llama":
        unsupported.append(f"block_type={raw.get('block_type')!r} (only 'llama')")
    if _get(raw, "activation_type", "silu") not in ("silu", "swiglu"):
        unsupported.append(f"activation_type={raw.get('activation_type')!r}")
    if _get(raw, "layer_norm_type", "rms") != "rms":
        unsupported.append(f"layer_norm_type={raw.get('layer_norm_type')!r} (only 'rms')")
    if raw.get("include_bias"):
        unsupported.append("include_bias=true")
    if raw.get("attention_layer_norm"):
        unsupported.append("attention_layer_norm=true")
    if raw.get("alibi") or raw.get("rope") is False:
        unsupported.append("positions other than RoPE")
    if unsupported:
        raise ValueError(f"config.json ({name}): unsupported LLaDA options: {', '.join(unsupported)}")
    theta, scaling = _rope(raw, name)
    return ModelConfig(
        vocab_size=int(emb), hidden_size=hidden, intermediate_size=int(mlp),
        num_layers=_positive(raw, "n_layers", name), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads, rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        max_position_embeddings=_int(raw, "max_sequence_length", name, required=False),
        qkv_bias=bool(raw.get("include_qkv_bias", False)),
        embed_scale=math.sqrt(hidden) if raw.get("input_emb_norm") else 1.0,
        logit_scale=1.0 / math.sqrt(hidden) if raw.get("scale_logits") else 1.0, **common)


def _check_consistency(cfg: ModelConfig) -> None:
    name = cfg.family
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"config.json ({name}): the attention heads ({cfg.num_heads}) must be a "
                         f"multiple of the key/value heads ({cfg.num_kv_heads})")
    if cfg.head_dim < 2 or cfg.head_dim % 2:
        raise ValueError(f"config.json ({name}): head_dim must be even for RoPE, got {cfg.head_dim}")
    if not (cfg.rms_norm_eps > 0):
        raise ValueError(f"config.json ({name}): rms_norm_eps must be positive, got {cfg.rms_norm_eps}")

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
    base: str  # weight layout: "llama", "qwen2", "qwen3" or "llada"
    attention: str  # one of ATTENTION_KINDS
    shifted: bool
    mask_token_id: int | None
    mask_tokens: tuple[str, ...] = ()  # tokenizer strings tried for the mask id
    block_size: int | None = None  # default for block_causal families


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), ("llama",), "llama", "causal", False, None),
        Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", "causal", False, None),
        Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", "causal", False, None),
        Family("llada", ("LLaDAModelLM",), ("llada",), "llada", "bidirectional", False, 126336, ("<|mdm_mask|>",)),
        Family("dream", ("DreamModel",), ("dream",), "qwen2", "bidirectional", True, 151666, ("<|mask|>",)),
        Family(
            "sdar", ("SDARForCausalLM",), ("sdar",), "qwen3", "block_causal", False, 151669, ("<|MASK|>", "<|mask|>"), 4
        ),
        Family(
            "fast_dllm_v2",
            ("Fast_dLLM_QwenForCausalLM",),
            ("fast_dllm_qwen",),
            "qwen2",
            "block_causal",
            True,
            151665,
            ("|<MASK>|",),
            32,
        ),
    )
}


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
    embed_scale: float = 1.0  # LLaDA input_emb_norm: embeddings * sqrt(d_model)
    logit_scale: float = 1.0  # LLaDA scale_logits: logits / sqrt(d_model)
    clean_causal: bool = False  # non-[MASK] queries see keys at positions <= theirs (mask_adapter)
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


# The largest sizes a config.json may declare: above every released model of the supported
# families (Llama 3.1 405B: 126 layers, hidden 16384, 128 heads, intermediate 53248; the
# largest vocabularies ~256k; contexts up to ~10M), and small enough that a lying config
# cannot make the loader build a huge parameter table or the decoder a huge position range.
# The loader then checks each size against the weights' actual shapes.
LIMITS = {
    "num_layers": 1024,
    "hidden_size": 65536,
    "num_heads": 1024,
    "head_dim": 4096,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "context": 1 << 24,
}


def detect_family(raw: dict) -> Family:
    """The family of a parsed config.json, from ``architectures`` then ``model_type``."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    archs = _architectures(raw)
    model_type = raw.get("model_type")
    model_type = model_type.lower() if isinstance(model_type, str) else ""
    for arch in archs:
        for fam in FAMILIES.values():
            if arch in fam.architectures:
                return fam
    if model_type:
        for fam in FAMILIES.values():
            if model_type in fam.model_types:
                return fam
    supported = ", ".join(f"{f.name} ({f.architectures[0]})" for f in FAMILIES.values())
    raise ValueError(
        f"unknown model family: config.json has architectures={archs!r}, "
        f"model_type={raw.get('model_type')!r}; supported: {supported}"
    )


def _architectures(raw: dict) -> list[str]:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: architectures must be a list of class names, got {archs!r:.80}")
    return archs


def _get(raw: dict, key: str, default=None, *, required: bool = False, family: str = ""):
    if key in raw and raw[key] is not None:
        return raw[key]
    if required:
        raise ValueError(f"config.json ({family}) is missing the required key {key!r}")
    return default


def _int(raw, key, family, default=None, required=True, *, lo=0, hi=None) -> int:
    """An integer config value in [lo, hi] (ValueError naming the key otherwise); None when
    absent and neither required nor defaulted."""
    value = _get(raw, key, default, required=required and default is None, family=family)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))
    ):
        raise ValueError(f"config.json ({family}): {key} must be an integer, got {value!r:.80}")
    value = int(value)
    if value < lo:
        raise ValueError(f"config.json ({family}): {key} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"config.json ({family}): {key} = {value} is above the largest size dspec accepts ({hi})")
    return value


def _positive(raw, key, family, default=None, *, limit=None) -> int:
    return _int(raw, key, family, default, lo=1, hi=LIMITS[limit] if limit else None)


def finite(value) -> bool:
    """Whether the number ``value`` is finite as a float (an int too large for one is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _float(raw, key, family, default, *, positive=True, where=None) -> float:
    """A finite number (> 0 when ``positive``) from ``raw[key]`` (ValueError naming it otherwise)."""
    value = _get(raw, key, default, family=family)
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and finite(value)
        and (value > 0 or not positive)
    )
    if not ok:
        raise ValueError(
            f"config.json ({family}): {where or key} must be a finite "
            f"{'positive ' if positive else ''}number, got {value!r:.80}"
        )
    return float(value)


def _flag(raw, key, family, default=False) -> bool:
    """A true / false config value (null: the default)."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"config.json ({family}): {key} must be true or false, got {value!r:.80}")


def _ids(value, key: str = "token id", where: str = "config.json") -> tuple[int, ...]:
    """A token id, a list of them or null (ValueError naming the file and key otherwise)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out = []
    for v in items:
        if v is None:
            continue
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (isinstance(v, float) and not (math.isfinite(v) and v.is_integer()))
        ):
            raise ValueError(f"{where}: {key} must be an integer token id or a list of them, got {value!r:.80}")
        out.append(int(v))
    return tuple(out)


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
    theta = _float({"rope_theta": theta}, "rope_theta", family, 10000.0)
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json ({family}): rope_scaling must be an object, got {scaling!r:.80}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None

    def number(key):
        if key not in scaling:
            raise ValueError(f"config.json ({family}): {kind} rope_scaling lacks {key!r}")
        return _float(scaling, key, family, None, where=f"rope_scaling.{key}")

    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": number("factor")}
    if kind == "llama3":
        out = {
            "rope_type": "llama3",
            "factor": number("factor"),
            "low_freq_factor": number("low_freq_factor"),
            "high_freq_factor": number("high_freq_factor"),
        }
        if "original_max_position_embeddings" not in scaling:
            raise ValueError(f"config.json ({family}): llama3 rope_scaling lacks 'original_max_position_embeddings'")
        out["original_max_position_embeddings"] = _int(
            scaling, "original_max_position_embeddings", family, lo=1, hi=LIMITS["context"]
        )
        return theta, out
    raise ValueError(
        f"config.json ({family}): rope_scaling type {kind!r:.80} is not supported (supported: default, linear, llama3)"
    )


def parse_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    """Normalise a config.json (and optional generation_config.json) into a ModelConfig.

    Every value is type-checked and every size bounded (:data:`LIMITS`): a malformed or
    lying config is a ValueError naming the file and key, before anything is allocated."""
    fam = detect_family(raw)
    name = fam.name
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ValueError(f"generation_config.json must hold a JSON object, got {type(generation_config).__name__}")
    archs = _architectures(raw) or [""]
    model_type = raw.get("model_type")
    common = dict(
        family=name,
        attention=fam.attention,
        shifted=fam.shifted,
        architecture=archs[0],
        model_type=model_type if isinstance(model_type, str) else "",
        raw=dict(raw),
    )
    if fam.base == "llada":
        cfg = _parse_llada(raw, name, common)
    else:
        cfg = _parse_hf(raw, fam, name, common)

    where = f"config.json ({name})"
    gen_where = f"generation_config.json ({name})"
    eos = _ids(raw.get("eos_token_id"), "eos_token_id", where)
    if generation_config:
        eos = eos + tuple(
            i for i in _ids(generation_config.get("eos_token_id"), "eos_token_id", gen_where) if i not in eos
        )
    bos = _ids(raw.get("bos_token_id"), "bos_token_id", where)
    if not bos and generation_config:
        bos = _ids(generation_config.get("bos_token_id"), "bos_token_id", gen_where)
    for key, ids in (("eos_token_id", eos), ("bos_token_id", bos)):
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise ValueError(
                f"{where} / generation_config.json: {key} {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
            )
    pad = _ids(raw.get("pad_token_id"), "pad_token_id", where)  # out of range: no pad (plan pads with 0)
    mask = _int(raw, "mask_token_id", name, required=False)
    block = None
    if fam.attention == "block_causal":
        block = _int(raw, "block_size", name, required=False)
        if block is None:
            block = _int(raw, "bd_size", name, default=fam.block_size)
        if block < 1:
            raise ValueError(f"config.json ({name}): block_size must be >= 1, got {block}")
        context = cfg.max_position_embeddings or LIMITS["context"]
        if block > context:
            raise ValueError(
                f"config.json ({name}): block_size = {block} is larger than the context ({context} tokens)"
            )
    cfg = cfg.replace(
        eos_token_ids=eos,
        bos_token_id=bos[0] if bos else None,
        pad_token_id=pad[0] if pad else None,
        block_size=block,
        mask_token_id=mask,
    )
    _check_consistency(cfg)
    return cfg


def _context(raw, key, name) -> int | None:
    """The context length (None when the config has none); >= 1 when given."""
    return _int(raw, key, name, required=False, lo=1, hi=LIMITS["context"])


def _parse_hf(raw, fam: Family, name: str, common: dict) -> ModelConfig:
    hidden = _positive(raw, "hidden_size", name, limit="hidden_size")
    heads = _positive(raw, "num_attention_heads", name, limit="num_heads")
    kv_heads = _positive(raw, "num_key_value_heads", name, default=heads, limit="num_heads")
    head_dim = _int(raw, "head_dim", name, required=False, lo=1, hi=LIMITS["head_dim"])
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"config.json ({name}): hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads} and head_dim is not given"
            )
        head_dim = hidden // heads
    act = _get(raw, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json ({name}): hidden_act {act!r:.80} is not supported (SwiGLU with silu only)")
    if raw.get("use_sliding_window"):
        raise ValueError(f"config.json ({name}): use_sliding_window=true is not supported")
    theta, scaling = _rope(raw, name)
    attn_bias = _flag(raw, "attention_bias", name)
    if fam.base == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attn_bias
    return ModelConfig(
        vocab_size=_positive(raw, "vocab_size", name, limit="vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", name, limit="intermediate_size"),
        num_layers=_positive(raw, "num_hidden_layers", name, limit="num_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_float(raw, "rms_norm_eps", name, 1e-6),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", name),
        max_position_embeddings=_context(raw, "max_position_embeddings", name),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=_flag(raw, "mlp_bias", name) if fam.base == "llama" else False,
        qk_norm=fam.base == "qwen3",
        **common,
    )


def _parse_llada(raw, name: str, common: dict) -> ModelConfig:
    """LLaDA's OLMo-style config (d_model, n_layers, n_heads, mlp_hidden_size, ...)."""
    hidden = _positive(raw, "d_model", name, limit="hidden_size")
    heads = _positive(raw, "n_heads", name, limit="num_heads")
    default_kv = 1 if _flag(raw, "multi_query_attention", name) else heads
    kv_heads = _positive(raw, "n_kv_heads", name, default=default_kv, limit="num_heads")
    if hidden % heads:
        raise ValueError(f"config.json ({name}): d_model {hidden} is not a multiple of n_heads {heads}")
    mlp = _int(raw, "mlp_hidden_size", name, required=False, lo=1, hi=LIMITS["intermediate_size"])
    if mlp is None:
        ratio = _positive(raw, "mlp_ratio", name, default=4, limit="intermediate_size")
        mlp = ratio * hidden
        if mlp > LIMITS["intermediate_size"]:
            raise ValueError(
                f"config.json ({name}): mlp_ratio * d_model = {mlp} is above the largest size "
                f"dspec accepts ({LIMITS['intermediate_size']})"
            )
    vocab = _positive(raw, "vocab_size", name, limit="vocab_size")
    emb = _int(raw, "embedding_size", name, required=False, lo=1, hi=LIMITS["vocab_size"]) or vocab
    unsupported = []
    if _get(raw, "block_type", "llama") != "llama":
        unsupported.append(f"block_type={raw.get('block_type')!r:.40} (only 'llama')")
    if _get(raw, "activation_type", "silu") not in ("silu", "swiglu"):
        unsupported.append(f"activation_type={raw.get('activation_type')!r:.40}")
    if _get(raw, "layer_norm_type", "rms") != "rms":
        unsupported.append(f"layer_norm_type={raw.get('layer_norm_type')!r:.40} (only 'rms')")
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
        vocab_size=emb,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_layers=_positive(raw, "n_layers", name, limit="num_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_float(raw, "rms_norm_eps", name, 1e-5),
        tie_word_embeddings=_flag(raw, "weight_tying", name),
        max_position_embeddings=_context(raw, "max_sequence_length", name),
        qkv_bias=_flag(raw, "include_qkv_bias", name),
        embed_scale=math.sqrt(hidden) if _flag(raw, "input_emb_norm", name) else 1.0,
        logit_scale=1.0 / math.sqrt(hidden) if _flag(raw, "scale_logits", name) else 1.0,
        **common,
    )


def _check_consistency(cfg: ModelConfig) -> None:
    name = cfg.family
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"config.json ({name}): the attention heads ({cfg.num_heads}) must be a "
            f"multiple of the key/value heads ({cfg.num_kv_heads})"
        )
    if cfg.head_dim < 2 or cfg.head_dim % 2:
        raise ValueError(f"config.json ({name}): head_dim must be even for RoPE, got {cfg.head_dim}")
    if not (cfg.rms_norm_eps > 0):
        raise ValueError(f"config.json ({name}): rms_norm_eps must be positive, got {cfg.rms_norm_eps}")

"""dspec.models: checkpoint loading for every family, logit parity with transformers, errors.

transformers is a test-only dependency (requirements-dev.txt); the parity tests skip without
it.  Tiny models (hidden 64, 2 layers, vocab 160) keep the file at a few seconds.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dspec
from dspec.models import AttentionPlan, KVCache, load_checkpoint
from tiny_checkpoints import (
    FAMILIES,
    MASK_TOKEN,
    family_config,
    family_weights,
    llada_to_llama,
    save_weights,
    write_checkpoint,
)

TOL = dict(rtol=1e-4, atol=1e-4)

EXPECTED = {  # family -> (attention, shifted, mask id in the tiny checkpoint, block size)
    "llama": ("causal", False, None, None),
    "qwen2": ("causal", False, None, None),
    "qwen3": ("causal", False, None, None),
    "llada": ("bidirectional", False, 3, None),
    "dream": ("bidirectional", True, 3, None),
    "sdar": ("block_causal", False, 3, 4),
    "fast_dllm_v2": ("block_causal", True, 3, 4),
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {fam: write_checkpoint(root / fam, fam) for fam in FAMILIES}


def _ids(batch, n, vocab=160, seed=0):
    return torch.randint(4, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _additive(dense: torch.Tensor) -> torch.Tensor:
    """bool [N, N] (query, key) -> transformers' additive 4D float mask [1, 1, N, N]."""
    return torch.zeros(dense.shape).masked_fill(~dense, float("-inf"))[None, None]


def _block_causal(n, block):
    pos = torch.arange(n)
    return (pos[None, :] // block) <= (pos[:, None] // block)


# ------------------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_every_family(ckpts, family):
    model = load_checkpoint(ckpts[family])
    attention, shifted, mask_id, block = EXPECTED[family]
    assert model.family == family
    assert model.attention == attention and model.shifted is shifted
    assert model.mask_token_id == mask_id and model.block_size == block
    assert model.block_causal is (attention == "block_causal")
    cfg = model.config
    raw = json.loads((ckpts[family] / "config.json").read_text())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (160, 64, 2, 4, 2)
    assert cfg.head_dim == (32 if family in ("qwen3", "sdar") else 16)
    assert cfg.intermediate_size == 96 and cfg.max_position_embeddings == 256
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2,) and cfg.eos_token_id == 2 and cfg.bos_token_id == 1
    assert cfg.tie_word_embeddings is False
    assert cfg.qkv_bias is (family in ("qwen2", "dream", "fast_dllm_v2"))
    assert cfg.qk_norm is (family in ("qwen3", "sdar"))
    assert cfg.raw == raw
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not any(p.requires_grad for p in model.parameters())
    # the tokenizer (tokenizers library) round-trips and knows the specials
    tok = model.tokenizer
    assert tok is not None and tok.eos_token_id == 2 and tok.bos_token_id == 1
    ids = tok.encode("w0 w7 w3")
    assert tok.decode(ids) == "w0 w7 w3"
    if family in MASK_TOKEN:
        assert tok.token_to_id(MASK_TOKEN[family]) == model.mask_token_id
    # a forward runs under the model's own attention
    out = model(model.plan([[5, 6, 7, 8, 9, 10], [11, 12, 13]]))
    assert out.logits.shape == (2, 6, 160) and torch.isfinite(out.logits).all()
    assert out.suffix_kv.num_layers == 2 and out.suffix_kv.shape == (2, 6, 2, cfg.head_dim)


def test_family_detection_by_model_type_only(tmp_path):
    ckpt = write_checkpoint(tmp_path / "d", "dream", config_overrides={"architectures": None})
    assert load_checkpoint(ckpt).family == "dream"


def test_mask_id_from_tokenizer_or_family_default(tmp_path):
    # SDAR / Fast-dLLM v2 configs carry no mask_token_id: the tokenizer's mask token gives it
    ckpt = write_checkpoint(tmp_path / "s", "fast_dllm_v2")
    assert "mask_token_id" not in json.loads((ckpt / "config.json").read_text())
    assert load_checkpoint(ckpt).mask_token_id == 3
    # without a tokenizer the family's id is used, and must fit the vocabulary
    ckpt = write_checkpoint(tmp_path / "big", "sdar", tokenizer=False, vocab=151700)
    model = load_checkpoint(ckpt)
    assert model.tokenizer is None and model.mask_token_id == 151669
    ckpt = write_checkpoint(tmp_path / "small", "sdar", tokenizer=False)
    with pytest.raises(ValueError, match="mask token id 151669.*outside the vocabulary"):
        load_checkpoint(ckpt)


def test_checkpoint_without_tokenizer(tmp_path):
    model = load_checkpoint(write_checkpoint(tmp_path / "c", "llama", tokenizer=False))
    assert model.tokenizer is None and model.mask_token_id is None


def test_sharded_and_tied_and_dtype(tmp_path):
    single = load_checkpoint(write_checkpoint(tmp_path / "one", "qwen2", seed=3))
    sharded = load_checkpoint(write_checkpoint(tmp_path / "three", "qwen2", seed=3, shards=3))
    assert (tmp_path / "three" / "model.safetensors.index.json").is_file()
    plan = AttentionPlan.sequences(_ids(1, 7))
    torch.testing.assert_close(sharded(plan).logits, single(plan).logits, rtol=0, atol=0)

    tied = load_checkpoint(write_checkpoint(tmp_path / "tied", "llama", tie=True))
    assert tied.config.tie_word_embeddings and tied.lm_head is None
    out = tied(AttentionPlan.sequences(_ids(1, 5)), hidden_states=[-1])
    torch.testing.assert_close(out.logits, out.hidden[0] @ tied.embed_tokens.weight.t())

    bf16 = load_checkpoint(tmp_path / "one", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    cache = bf16.new_cache(1)
    assert cache.dtype == torch.bfloat16
    out = bf16(AttentionPlan.sequences(_ids(1, 7), cache=cache))
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.logits.float(), single(plan).logits, rtol=0.1, atol=0.5)
    # stored dtype is kept by default
    save_weights(
        tmp_path / "one", {k: v.half() for k, v in family_weights("qwen2", family_config("qwen2"), seed=3).items()}
    )
    assert load_checkpoint(tmp_path / "one").dtype == torch.float16
    assert load_checkpoint(tmp_path / "one", dtype=torch.float32).dtype == torch.float32


# ------------------------------------------------------------------------- parity (HF)


def _hf_causal(transformers, family, tmp_path, **extra):
    """A transformers model with large random weights, saved with save_pretrained."""
    cls_cfg, cls_model = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    kw = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        kw["head_dim"] = 32
    kw.update(extra)
    cfg = getattr(transformers, cls_cfg)(**kw)
    torch.manual_seed(0)
    hf = getattr(transformers, cls_model)._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_((1.0 if "embed" in name else 0.2) * torch.randn_like(p))
    path = tmp_path / family
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False)])
def test_parity_with_transformers(transformers, tmp_path, family, tie):
    hf, path = _hf_causal(transformers, family, tmp_path, tie_word_embeddings=tie)
    model = load_checkpoint(path)
    assert model.family == family and model.config.tie_word_embeddings is tie
    ids = _ids(2, 13, seed=1)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        # 1) full sequence: one forward, causal mask, no prefix
        plan = AttentionPlan(ids, torch.arange(13).expand(2, 13), dspec.masks.causal(13).words)
        out = model(plan, hidden_states=[0, 1, 2])
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        for mine, theirs in zip(out.hidden, ref.hidden_states):
            torch.testing.assert_close(mine, theirs, **TOL)
        # 2) prefix, commit, then a suffix over the cache = the full forward's last logits
        cache = model.new_cache(2)
        first = model(model.plan(ids[:, :8], cache))
        torch.testing.assert_close(first.logits, ref.logits[:, :8], **TOL)
        cache.append(first.suffix_kv)
        assert cache.lengths.tolist() == [8, 8]
        second = model(model.plan(ids[:, 8:], cache))
        torch.testing.assert_close(second.logits, ref.logits[:, 8:], **TOL)
        cache.append(second.suffix_kv)
        # 3) one token at a time from a 1-token prefix (AR decoding)
        cache = model.new_cache(2)
        for t in range(13):
            step = model(AttentionPlan.from_offsets(ids[:, t : t + 1], [0], None, cache), logits="last")
            torch.testing.assert_close(step.logits[:, 0], ref.logits[:, t], **TOL)
            cache.append(step.suffix_kv)


def test_parity_llama3_and_linear_rope_scaling(transformers, tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    for name, rope in (("llama3", scaling), ("linear", {"rope_type": "linear", "factor": 4.0})):
        hf, path = _hf_causal(transformers, "llama", tmp_path / name, rope_parameters={"rope_theta": 50000.0, **rope})
        model = load_checkpoint(path)
        assert model.config.rope_scaling["rope_type"] == name and model.config.rope_theta == 50000.0
        ids = _ids(1, 40, seed=2)
        with torch.no_grad():
            torch.testing.assert_close(model(model.plan(ids)).logits, hf(ids).logits, **TOL)
    # pre-transformers-5 spelling (rope_theta + rope_scaling) of the same config
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 4.0})
    (path / "config.json").write_text(json.dumps(raw))
    again = load_checkpoint(path)
    assert again.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with torch.no_grad():
        torch.testing.assert_close(again(again.plan(ids)).logits, hf(ids).logits, **TOL)


def _hf_from_family(transformers, family, ckpt):
    """The transformers model computing what a diffusion family computes (up to its mask)."""
    raw = json.loads((ckpt / "config.json").read_text())
    weights = family_weights(family, raw)
    if family == "llada":
        cfg = transformers.LlamaConfig(
            vocab_size=raw["embedding_size"],
            hidden_size=raw["d_model"],
            intermediate_size=raw["mlp_hidden_size"],
            num_hidden_layers=raw["n_layers"],
            num_attention_heads=raw["n_heads"],
            num_key_value_heads=raw["n_kv_heads"],
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=raw["rope_theta"],
            tie_word_embeddings=raw["weight_tying"],
        )
        cls, weights = transformers.LlamaForCausalLM, llada_to_llama(weights)
    else:
        keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
        if family in ("dream", "fast_dllm_v2"):
            cfg, cls = transformers.Qwen2Config(**keep), transformers.Qwen2ForCausalLM
        else:
            cfg, cls = transformers.Qwen3Config(**keep), transformers.Qwen3ForCausalLM
    hf = cls._from_config(cfg, attn_implementation="eager").eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "fast_dllm_v2"])
def test_diffusion_families_match_transformers_under_their_mask(transformers, ckpts, family):
    """LLaDA = Llama, Dream / Fast-dLLM v2 = Qwen2, SDAR = Qwen3, each under its own
    attention: bidirectional (LLaDA, Dream) or block-causal (SDAR, Fast-dLLM v2).  Also the
    cached path: a committed prefix of whole blocks, then a suffix block, equals one forward
    in which prefix tokens do not see the suffix."""
    model = load_checkpoint(ckpts[family])
    hf = _hf_from_family(transformers, family, ckpts[family])
    n, p = 11, 8  # 8 prefix tokens = 2 blocks of 4, then 3 more
    ids = _ids(1, n, seed=4)
    if model.attention == "bidirectional":
        dense = torch.ones(n, n, dtype=torch.bool)
        cached = dense.clone()
        cached[:p, p:] = False  # the prefix was computed without the suffix
    else:
        dense = _block_causal(n, model.block_size)
        cached = dense
    with torch.no_grad():
        torch.testing.assert_close(
            model(model.plan(ids)).logits, hf(ids, attention_mask=_additive(dense)).logits, **TOL
        )
        ref = hf(ids, attention_mask=_additive(cached)).logits
        cache = model.new_cache(1)
        first = model(model.plan(ids[:, :p], cache))
        cache.append(first.suffix_kv)
        block = dspec.masks.block_diffusion(n - p)
        out = model(AttentionPlan.from_offsets(ids[:, p:], block.positions, block.words, cache))
        torch.testing.assert_close(out.logits, ref[:, p:], **TOL)


# ------------------------------------------------------------------------- forward options


def test_logits_selection_and_hidden_states(ckpts):
    model = load_checkpoint(ckpts["qwen3"])
    plan = model.plan([[5, 6, 7, 8, 9], [10, 11, 12]])
    full = model(plan, hidden_states=[2, 0, -1])
    assert [h.shape for h in full.hidden] == [(2, 5, 64)] * 3
    torch.testing.assert_close(full.hidden[1], model.embed_tokens(plan.tokens))
    last = model(plan, logits="last")
    torch.testing.assert_close(last.logits[:, 0], full.logits[[0, 1], [4, 2]])
    picked = model(plan, logits=torch.tensor([[4, 0], [2, 1]]))
    torch.testing.assert_close(picked.logits, full.logits[[[0, 0], [1, 1]], [[4, 0], [2, 1]]])
    shared = model(plan, logits=torch.tensor([1]))
    torch.testing.assert_close(shared.logits, full.logits[:, 1:2])
    none = model(plan, logits=None, return_kv=False)
    assert none.logits is None and none.suffix_kv is None and none.hidden is None
    # right-padded rows do not change the valid rows
    alone = model(model.plan([[10, 11, 12]]))
    torch.testing.assert_close(full.logits[1:, :3], alone.logits, **TOL)


@pytest.mark.parametrize("attention", ["causal", "bidirectional", "block_causal"])
def test_plan_of_a_padded_tensor_with_lengths_equals_the_list_form(ckpts, attention):
    """model.plan(tokens [B, N], lengths=...) -- a decode loop's array-built ragged batch --
    is the plan of the list of its valid prefixes (whatever the padding holds), after a cache
    too; bad lengths are refused."""
    model = load_checkpoint(ckpts["qwen3"])
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    padded = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 40, 41, 42], [12, 13, 14, 43, 44]])
    lengths = torch.tensor([5, 2, 3])
    cache = model.new_cache(3)
    pre = model.plan([[1, 2, 3], [4], [2, 2]], cache)
    cache.append(model(pre).suffix_kv, counts=pre.lengths)
    for c in (None, cache):
        want = model.plan(seqs, c, attention=attention, block_size=2)
        got = model.plan(padded, c, attention=attention, block_size=2, lengths=lengths)
        for field in ("tokens", "positions", "mask", "lengths"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None and b is None) or torch.equal(a, b), field
    full = model.plan(padded, lengths=torch.tensor([5, 5, 5]))
    assert torch.equal(full.tokens, padded) and torch.equal(full.mask, model.plan(padded).mask)
    for bad, match in (
        (torch.tensor([5, 0, 3]), "lengths must lie in"),
        (torch.tensor([5, 6, 3]), "lengths must lie in"),
        (torch.tensor([5, 2]), "lengths must be host ints"),
        (torch.tensor([5.0, 2.0, 3.0]), "lengths must be host ints"),
    ):
        with pytest.raises(ValueError, match=match):
            model.plan(padded, lengths=bad)
    with pytest.raises(ValueError, match="lengths go with a"):
        model.plan(seqs, lengths=lengths)


def test_forward_rejects_bad_plans(ckpts):
    model = load_checkpoint(ckpts["llama"])
    ids = _ids(1, 4)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="plan must be an AttentionPlan"):
        model(ids)
    with pytest.raises(ValueError, match="plan.tokens must lie in"):
        model(AttentionPlan(torch.tensor([[1, 2, 999, 3]]), pos))
    with pytest.raises(ValueError, match="plan.positions must have the shape"):
        model(AttentionPlan(ids, pos[:, :3]))
    with pytest.raises(ValueError, match="plan.positions must be >= 0"):
        model(AttentionPlan(ids, pos - 1))
    with pytest.raises(ValueError, match="plan.tokens must have dtype"):
        model(AttentionPlan(ids.float(), pos))
    with pytest.raises(ValueError, match="mask"):
        model(AttentionPlan(ids, pos, torch.zeros(3, 1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="plan.cache holds 2 requests"):
        model(AttentionPlan(ids, pos, None, model.new_cache(2)))
    with pytest.raises(ValueError, match="plan.cache has layers"):
        model(AttentionPlan(ids, pos, None, KVCache(3, 1, 2, 16)))
    with pytest.raises(ValueError, match="hidden_states"):
        model(AttentionPlan(ids, pos), hidden_states=[3])
    with pytest.raises(ValueError, match="logits indices must lie"):
        model(AttentionPlan(ids, pos), logits=torch.tensor([4]))
    with pytest.raises(ValueError, match="logits must be"):
        model(AttentionPlan(ids, pos), logits="first")


# ------------------------------------------------------------------------- malformed


def _copy(ckpts, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(ckpts[family], dst)
    return dst


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (path / "config.json").write_text(json.dumps(raw))


def _edit_weights(path, family, edit):
    raw = json.loads((path / "config.json").read_text())
    weights = family_weights(family, raw)
    edit(weights)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_weights(path, weights)


def test_malformed_checkpoints(ckpts, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(empty)

    bad = _copy(ckpts, "llama", tmp_path / "json")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_checkpoint(bad)

    unknown = _copy(ckpts, "llama", tmp_path / "unknown")
    _edit_config(unknown, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"unknown model family.*GPT2LMHeadModel.*supported: llama"):
        load_checkpoint(unknown)
    _edit_config(unknown, architectures=None, model_type=None)
    with pytest.raises(ValueError, match="unknown model family"):
        load_checkpoint(unknown)

    nokey = _copy(ckpts, "qwen2", tmp_path / "nokey")
    _edit_config(nokey, hidden_size=None)
    with pytest.raises(ValueError, match="missing the required key 'hidden_size'"):
        load_checkpoint(nokey)

    gqa = _copy(ckpts, "qwen2", tmp_path / "gqa")
    _edit_config(gqa, num_key_value_heads=3)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        load_checkpoint(gqa)

    rope = _copy(ckpts, "llama", tmp_path / "rope")
    _edit_config(rope, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        load_checkpoint(rope)

    llada = _copy(ckpts, "llada", tmp_path / "lladaopt")
    _edit_config(llada, include_bias=True, block_type="sequential")
    with pytest.raises(ValueError, match="unsupported LLaDA options: block_type"):
        load_checkpoint(llada)

    noweights = _copy(ckpts, "qwen3", tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    (noweights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*.safetensors weights.*pytorch_model.bin"):
        load_checkpoint(noweights)

    missing = _copy(ckpts, "llada", tmp_path / "missing")
    _edit_weights(missing, "llada", lambda w: w.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.transformer.blocks.1.up_proj.weight'\]"):
        load_checkpoint(missing)

    shape = _copy(ckpts, "qwen3", tmp_path / "shape")
    _edit_weights(shape, "qwen3", lambda w: w.update({"model.layers.0.self_attn.k_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"wrong shape.*k_norm.weight: expected \[32\], got \[16\]"):
        load_checkpoint(shape)

    bias = _copy(ckpts, "qwen2", tmp_path / "bias")
    _edit_weights(bias, "qwen2", lambda w: w.pop("model.layers.0.self_attn.q_proj.bias"))
    with pytest.raises(ValueError, match="missing weights.*q_proj.bias"):
        load_checkpoint(bias)

    extra = _copy(ckpts, "llama", tmp_path / "extra")
    _edit_weights(extra, "llama", lambda w: w.update({"model.layers.0.mlp.experts.0.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match="unexpected weights.*experts"):
        load_checkpoint(extra)

    shard = _copy(ckpts, "llama", tmp_path / "shard")
    (shard / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="shards listed in model.safetensors.index.json are missing"):
        load_checkpoint(shard)

    corrupt = _copy(ckpts, "llama", tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load_checkpoint(corrupt)

    with pytest.raises(ValueError, match="dtype must be"):
        load_checkpoint(ckpts["llama"], dtype="int8")

"""DFlash drafters in z-lab's format (``architectures: ["DFlashDraftModel"]``, the
checkpoints vLLM / SGLang / llama.cpp load with ``--speculative-algorithm DFLASH``).

The tests write tiny random drafters in that format (its config keys and weight names) for
the tiny target and compare dspec's drafts with a plain-torch statement of z-lab's forward
written here: context features = ``fc`` over the concatenated transformers-style hidden
states ``hidden_states[i + 1]`` of z-lab's ``target_layer_ids``, then ``hidden_norm``;
masked slots embed the target's ``mask_token_id``; every layer normalises its queries and
keys per head (RMSNorm) before RoPE; block slots attend to every context position and to
the whole block; the target's head reads the final norm.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import dspec
from dspec.models.dflash import MASK, load_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

MASK_ID = 4000
CONTEXTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def target():
    return dspec.load("tiny-ar")


def zlab_config(target, *, num_layers=2, block_size=4, layer_ids=(1, 3), mask_token_id=MASK_ID, **over):
    """A config.json as z-lab's drafters ship it: a Qwen3 config plus block_size,
    num_target_layers and dflash_config."""
    tc = target.config
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": None,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
        "dtype": "float32",
        "eos_token_id": 0,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": tc.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": 384,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 4096,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 2,
        "num_target_layers": tc.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": tc.vocab_size,
    }
    cfg.update(over)
    return cfg


def zlab_weights(cfg, seed=0):
    """Random weights under z-lab's names (norm weights near 1, so every norm matters)."""
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) * cols**-0.5

    def norm(size):
        return 1.0 + 0.2 * torch.randn(size, generator=g)

    w = {"fc.weight": mat(h, n_ctx * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": mat(hq * d, h),
            p + "self_attn.k_proj.weight": mat(hkv * d, h),
            p + "self_attn.v_proj.weight": mat(hkv * d, h),
            p + "self_attn.o_proj.weight": mat(h, hq * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    return w


def write_zlab(path, cfg, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


# ----------------------------------------------------------------------- the reference


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x [N, heads, D] at positions pos [N], rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_drafts(target, cfg, w, context, anchor):
    """z-lab's draft logits [block_size - 1, V] for the slots after ``anchor``, the context
    ``context`` (ids) committed before it."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = cfg["block_size"]
    n = len(context)
    with torch.no_grad():
        # transformers' output_hidden_states: (embeddings, layer 1 .. L-1 outputs, final normed)
        hs = target(target.plan([context]), hidden_states=list(range(target.config.num_layers + 1))).hidden
        feats = torch.cat([hs[i + 1][0] for i in cfg["dflash_config"]["target_layer_ids"]], -1)
        ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [n, H]
        block = torch.tensor([anchor] + [cfg["dflash_config"]["mask_token_id"]] * (g - 1))
        x = target.embed_tokens.weight[block].float()  # [g, H]
        pos = torch.arange(n + g)
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"], eps)
            q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(g, hq, d), w[p + "self_attn.q_norm.weight"], eps)
            both = torch.cat([ctx, h])
            k = rms(
                (both @ w[p + "self_attn.k_proj.weight"].T).view(n + g, hkv, d), w[p + "self_attn.k_norm.weight"], eps
            )
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(n + g, hkv, d)
            q, k = rope(q, pos[n:], theta), rope(k, pos, theta)
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * d**-0.5, -1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(g, hq * d)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return (rms(x, w["norm.weight"], eps) @ target.output_weight.float().T)[1:]


def dspec_drafts(drafter, target, contexts, anchors):
    """dspec's decoding path: context keys / values cached, one block per request."""
    g = drafter.block_size
    with torch.no_grad():
        out = target(target.plan(contexts), hidden_states=drafter.target_layer_ids)
        n = max(len(c) for c in contexts)
        cache = drafter.new_cache(len(contexts))
        cache.append(
            drafter.context_kv(out.hidden, torch.arange(n).expand(len(contexts), n)), counts=[len(c) for c in contexts]
        )
        block = torch.tensor([[a] + [MASK] * (g - 1) for a in anchors])
        pos = torch.tensor([[len(c) + j for j in range(g)] for c in contexts])
        return drafter(block, pos, cache, logits_from=1), out.hidden, block, pos


# ----------------------------------------------------------------------- tests


def test_zlab_config_translates(target, tmp_path):
    cfg = zlab_config(target, layer_ids=[0, 3])
    d = load_drafter(write_zlab(tmp_path / "z", cfg, zlab_weights(cfg)), target)
    c = d.config
    # z-lab's id i reads hidden_states[i + 1]: dspec's hidden-state index i + 1 (3 = the last
    # decoder layer = dspec's 4, the final normed output, as in transformers' tuple)
    assert d.target_layer_ids == [1, 4]
    assert c.kind == "dflash" and c.qk_norm and c.mask_token_id == MASK_ID and c.block_size == 4
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (2, 4, 2, 32, 384)
    assert c.rope_theta == 1e6 and d.mask_embedding is None
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in d.layers)


@pytest.mark.parametrize("layer_ids", [[1, 3], [0, 2, 3], [2]])
def test_draft_logits_equal_the_reference(target, tmp_path, layer_ids):
    cfg = zlab_config(target, num_layers=len(layer_ids) % 2 + 1, block_size=5, layer_ids=layer_ids)
    w = zlab_weights(cfg, seed=len(layer_ids))
    d = load_drafter(write_zlab(tmp_path / "z", cfg, w), target)
    anchors = [33, 7, 4095]
    got, hidden, block, pos = dspec_drafts(d, target, CONTEXTS, anchors)
    for b, (ctx, a) in enumerate(zip(CONTEXTS, anchors)):
        ref = reference_drafts(target, cfg, w, ctx, a)
        torch.testing.assert_close(got[b], ref, atol=2e-5, rtol=1e-5)
    # the training path computes the same function (context rows beyond a request's length unseen)
    with torch.no_grad():
        lengths = torch.tensor([len(c) for c in CONTEXTS])
        lt = d.forward_train(hidden, block[:, None], pos[:, :1], context_length=lengths)
    torch.testing.assert_close(lt[:, 0, 1:], got, atol=2e-5, rtol=1e-5)


def test_mask_slot_is_the_target_embedding_of_mask_token_id(target, tmp_path):
    cfg = zlab_config(target)
    d = load_drafter(write_zlab(tmp_path / "z", cfg, zlab_weights(cfg)), target)
    masked = d.embed_block(torch.tensor([[3, MASK, MASK]]))
    assert torch.equal(masked[0, 1], target.embed_tokens.weight[MASK_ID].to(masked.dtype))
    assert torch.equal(masked, d.embed_block(torch.tensor([[3, MASK_ID, MASK_ID]])))


def test_generate_greedy_is_lossless(target, tmp_path):
    cfg = zlab_config(target, block_size=4)
    path = write_zlab(tmp_path / "z", cfg, zlab_weights(cfg, seed=3))
    for p in CONTEXTS:
        ar = dspec.generate(target, p, method="ar", max_new_tokens=16).tokens
        assert dspec.generate(target, p, method="dflash", drafter=str(path), max_new_tokens=16).tokens == ar
        assert dspec.generate(target, p, method="d2sd", drafter=path, max_new_tokens=16).tokens == ar


def test_generate_batch_is_lossless(target, tmp_path):
    cfg = zlab_config(target, block_size=6)
    path = write_zlab(tmp_path / "z", cfg, zlab_weights(cfg, seed=4))
    ar = [dspec.generate(target, p, method="ar", max_new_tokens=12).tokens for p in CONTEXTS]
    assert [o.tokens for o in dspec.generate(target, CONTEXTS, method="dflash", drafter=path, max_new_tokens=12)] == ar


def test_dspec_drafters_keep_their_weights_and_mask_embedding(target, tmp_path):
    """q / k norm and the token mask slot are options: dspec's own drafters do not change."""
    from dspec.models.dflash import BlockDrafter, shipped_drafter_path

    d = load_drafter("tiny-ar-dflash", target)
    assert not d.config.qk_norm and d.config.mask_token_id is None and d.mask_embedding is not None
    assert all(layer.q_norm is None for layer in d.layers)
    from safetensors import safe_open

    with safe_open(str(shipped_drafter_path("tiny-ar", "dflash") / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(d.state_dict())
    fresh = BlockDrafter.for_target(target, block_size=4)
    assert not any("q_norm" in k or "k_norm" in k for k in fresh.state_dict())


@pytest.mark.parametrize("fmt", ["zlab", "dspec"])
def test_save_round_trip(target, tmp_path, fmt):
    cfg = zlab_config(target, layer_ids=[0, 2])
    d = load_drafter(write_zlab(tmp_path / "z", cfg, zlab_weights(cfg, seed=5)), target)
    d.save(tmp_path / "out", format=fmt)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    if fmt == "zlab":
        assert saved["architectures"] == ["DFlashDraftModel"]
        assert saved["dflash_config"] == cfg["dflash_config"]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
            "num_target_layers",
            "vocab_size",
            "rope_theta",
        ):
            assert saved[k] == cfg[k], k
        from safetensors import safe_open

        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            assert set(f.keys()) == set(zlab_weights(cfg))
    e = load_drafter(tmp_path / "out", target)
    a = dspec_drafts(d, target, CONTEXTS, [1, 2, 3])[0]
    assert torch.equal(dspec_drafts(e, target, CONTEXTS, [1, 2, 3])[0], a)


def test_zlab_save_refuses_what_the_format_cannot_hold(target, tmp_path):
    from dspec.models.dflash import BlockDrafter

    with pytest.raises(ValueError, match="qk_norm"):
        BlockDrafter.for_target(target, block_size=4).save(tmp_path / "x", format="zlab")
    with pytest.raises(ValueError, match="format"):
        BlockDrafter.for_target(target, block_size=4).save(tmp_path / "x", format="hf")


def _bad(target, tmp_path, cfg=None, weights=None, **over):
    cfg = cfg or zlab_config(target, **over)
    weights = zlab_weights(cfg) if weights is None else weights
    return write_zlab(tmp_path / "bad", cfg, weights)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: c.pop("hidden_size"), r"needs \['hidden_size'\]"),
        (lambda c: c.pop("num_target_layers"), "num_target_layers"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(dflash_config=[1, 2]), "dflash_config must be an object"),
        (lambda c: c["dflash_config"].update(mask_token_id=5000), "mask_token_id"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 4]), r"target_layer_ids .*\[0, 4\)"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
        (lambda c: c.update(attention_bias=True), "attention_bias"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (lambda c: c.update(use_sliding_window=True), "sliding"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(block_size=1), "block_size"),
    ],
)
def test_bad_configs_raise(target, tmp_path, change, match):
    cfg = zlab_config(target)
    weights = zlab_weights(cfg)
    change(cfg)
    with pytest.raises(ValueError, match=match):
        load_drafter(_bad(target, tmp_path, cfg, weights), target)


def test_drafters_for_another_target_raise(target, tmp_path):
    with pytest.raises(ValueError, match="hidden_size 128 does not match the target's 256"):
        load_drafter(_bad(target, tmp_path, zlab_config(target, hidden_size=128)), target)
    with pytest.raises(ValueError, match="8-layer target"):
        load_drafter(_bad(target, tmp_path, zlab_config(target, num_target_layers=8)), target)
    with pytest.raises(ValueError, match="vocab_size"):
        load_drafter(_bad(target, tmp_path, zlab_config(target, vocab_size=5000)), target)


def test_bad_weights_raise(target, tmp_path):
    cfg = zlab_config(target)
    w = zlab_weights(cfg)
    # fc over three target layers while the config names two
    bad = dict(w, **{"fc.weight": torch.zeros(256, 3 * 256)})
    with pytest.raises(ValueError, match=r"wrong shapes \['fc.weight \[256, 768\] \(expected \[256, 512\]\)'\]"):
        load_drafter(_bad(target, tmp_path, cfg, bad), target)
    bad = {k: v for k, v in w.items() if k != "layers.1.self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.k_norm.weight'\]"):
        load_drafter(_bad(target, tmp_path, cfg, bad), target)
    # dspec's names under a z-lab config are not z-lab's weights
    bad = {("context_proj.weight" if k == "fc.weight" else k): v for k, v in w.items()}
    with pytest.raises(ValueError, match=r"unexpected \['context_proj.weight'\]"):
        load_drafter(_bad(target, tmp_path, cfg, bad), target)
    bad = dict(w, **{"layers.0.self_attn.q_proj.weight": torch.zeros(4 * 32, 100)})
    with pytest.raises(ValueError, match="q_proj"):
        load_drafter(_bad(target, tmp_path, cfg, bad), target)
    with pytest.raises(ValueError, match="expected 'vp'"):
        load_drafter(_bad(target, tmp_path, cfg, w), target, kind="vp")


def test_cli_trains_and_saves_a_zlab_drafter(target, tmp_path):
    """``python -m dspec.train.dflash --format zlab``: z-lab's config keys and weight names,
    loaded back (into dspec, as z-lab's format) to the same drafts, lossless."""
    from dspec.train.dflash import main

    out = tmp_path / "run"
    main(
        [
            "--target",
            "tiny-ar",
            "--out",
            str(out),
            "--max-steps",
            "2",
            "--num-prompts",
            "8",
            "--response-tokens",
            "6",
            "--sources",
            "arithmetic=1",
            "--block-size",
            "4",
            "--batch-size",
            "4",
            "--layers",
            "2",
            "--format",
            "zlab",
            "--mask-token-id",
            "17",
        ]
    )
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == 17 and cfg["block_size"] == 4
    assert cfg["num_target_layers"] == target.config.num_layers and cfg["num_hidden_layers"] == 2
    from safetensors import safe_open

    with safe_open(str(out / "drafter" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        weights = {k: f.get_tensor(k).float() for k in names}
    assert names == set(zlab_weights(cfg))
    d = load_drafter(out / "drafter", target)
    assert d.target_layer_ids == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    got = dspec_drafts(d, target, CONTEXTS[:1], [5])[0][0]
    torch.testing.assert_close(got, reference_drafts(target, cfg, weights, CONTEXTS[0], 5), atol=2e-5, rtol=1e-5)
    p = CONTEXTS[0]
    assert (
        dspec.generate(target, p, method="dflash", drafter=out / "drafter", max_new_tokens=10).tokens
        == dspec.generate(target, p, method="ar", max_new_tokens=10).tokens
    )
    with pytest.raises(SystemExit, match="draft vocabulary"):
        main(["--target", "tiny-ar", "--out", str(tmp_path / "v"), "--format", "zlab", "--draft-vocab", "100"])
    with pytest.raises(SystemExit, match="needs --format zlab"):
        main(["--target", "tiny-ar", "--out", str(tmp_path / "m"), "--mask-token-id", "3"])


def test_missing_layer_ids_take_zlabs_default(target, tmp_path):
    from dspec.models.dflash import zlab_default_layer_ids

    assert zlab_default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafter's ids
    assert zlab_default_layer_ids(4, 1) == [2]
    cfg = zlab_config(target, num_layers=1)
    del cfg["dflash_config"]["target_layer_ids"]
    w = zlab_weights(dict(cfg, dflash_config={"target_layer_ids": [2]}))
    assert load_drafter(write_zlab(tmp_path / "z", cfg, w), target).target_layer_ids == [3]

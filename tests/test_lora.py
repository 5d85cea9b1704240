"""LoRA adapters for dspec models (dspec.train.lora) and the bd-adapt --lora-rank path."""

import json
import sys
from pathlib import Path

import pytest
import torch

import dspec
from dspec.train.lora import (
    LoraConfig,
    apply_lora,
    base_fingerprint,
    load_adapter,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    save_adapter,
)

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoints import write_checkpoint


def logits_of(model, seqs):
    with torch.no_grad():
        return model(model.plan(seqs)).logits.float()


SEQS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]


@pytest.fixture
def llama(tmp_path):
    return write_checkpoint(tmp_path / "llama", "llama", seed=3)


def randomise(model, seed=0):
    """Non-zero B (and a moved embedding row) so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_zero_init_leaves_logits_unchanged(llama):
    model = dspec.load(llama, dtype=torch.float32)
    ref = logits_of(model, SEQS)
    apply_lora(model, LoraConfig(rank=4, embedding_rows=(3,)))
    assert torch.equal(logits_of(model, SEQS), ref)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and "embed_tokens.rows" in trainable
    assert len(trainable) == 2 * 7 * model.config.num_layers + 1


def test_merge_equals_unmerged_and_bad_config(llama):
    model = dspec.load(llama, dtype=torch.float32)
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), embedding_rows=(6, 7)))
    randomise(model)
    adapted = logits_of(model, SEQS + [[6, 7, 6]])
    merge_lora(model)
    assert not lora_parameters(model) and type(model.embed_tokens) is torch.nn.Embedding
    assert torch.allclose(logits_of(model, SEQS + [[6, 7, 6]]), adapted, atol=1e-5)
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(targets=("qkv",))
    with pytest.raises(ValueError, match="vocabulary does not grow"):
        apply_lora(dspec.load(llama), LoraConfig(embedding_rows=(10_000,)))


def test_save_load_round_trip_and_fingerprint(llama, tmp_path):
    model = dspec.load(llama, dtype=torch.float32)
    fp = base_fingerprint(model)
    assert base_fingerprint(dspec.load(llama, dtype=torch.bfloat16)) == fp  # dtype-robust
    apply_lora(model, LoraConfig(rank=2, embedding_rows=(4,)))
    randomise(model, seed=1)
    assert base_fingerprint(model) == fp  # adapters excluded
    want = logits_of(model, SEQS)
    save_adapter(tmp_path / "ad", model, "tiny-llama", {"note": "test"})
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["base_fingerprint"] == fp and config["meta"] == {"note": "test"}

    fresh = dspec.load(llama, dtype=torch.float32)
    load_adapter(fresh, tmp_path / "ad")
    assert all(torch.equal(a, b) for a, b in zip(lora_state_dict(fresh).values(), lora_state_dict(model).values()))
    assert torch.allclose(logits_of(fresh, SEQS), want, atol=1e-6)
    merged = dspec.load(llama, dtype=torch.float32)
    load_adapter(merged, tmp_path / "ad", merge=True)
    assert torch.allclose(logits_of(merged, SEQS), want, atol=1e-5)

    other = dspec.load(write_checkpoint(tmp_path / "other", "llama", seed=4), dtype=torch.float32)
    with pytest.raises(ValueError, match="fingerprint"):
        load_adapter(other, tmp_path / "ad")
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_adapter(other, tmp_path / "nothing")
    with pytest.raises(ValueError, match="already has adapters"):
        load_adapter(fresh, tmp_path / "ad")


def run_lora_adapt(src, out, steps, **kw):
    from dspec.train import run_recipe

    return run_recipe(
        "bd-adapt",
        out,
        init=src,
        mask_token="<unk>",
        max_steps=steps,
        num_rows=16,
        progress=False,
        plot=False,
        lora_rank=4,
        lora_alpha=8.0,
        data_overrides={"weights": {"arithmetic": 1.0}, "seq_len": 16, "arithmetic_problems": 200, "heldout_rows": 2},
        train_overrides={
            "batch_size": 4,
            "eval_every": 0,
            "warmup_steps": 1,
            "lr": 3e-2,
            "min_lr": 3e-3,
            "block_sizes": (4,),
            "block_weights": None,
            "eval_block_sizes": (4,),
        },
        **kw,
    )


def test_bd_adapt_lora_trains_only_the_adapter_and_loads_through_the_hub(llama, tmp_path, monkeypatch):
    from dspec import hub
    from dspec.train.lora import read_adapter_config

    out = tmp_path / "run"
    first = run_lora_adapt(llama, out, 1)
    start = torch.load(out / "checkpoint.pt", weights_only=True)
    assert set(start["model"]) == {k for k in start["model"] if k.endswith(("lora_A", "lora_B", ".rows"))}
    summary = run_lora_adapt(llama, out, 12, resume=True)
    assert summary["family"] == "fast_dllm_v2" and summary["steps"] == 12 and summary["lora_rank"] == 4
    assert not (out / "model").exists() and (out / "adapter" / "adapter.safetensors").is_file()
    loss = [r["loss"] for r in json.loads((out / "train_log.json").read_text())["train"]]
    assert loss[-1] < loss[0]
    assert summary["heldout"]["arithmetic/bs4"]["nats_per_token"] < first["heldout"]["arithmetic/bs4"]["nats_per_token"]
    end = torch.load(out / "checkpoint.pt", weights_only=True)
    assert any(not torch.equal(start["model"][k], end["model"][k]) for k in start["model"])
    config = read_adapter_config(out / "adapter")
    assert config["meta"]["block_diffusion"]["family"] == "fast_dllm_v2"
    assert config["meta"]["block_diffusion"]["mask_token"] == "<unk>"

    # dspec.load("smollm2-135m-bd"): the tiny llama stands in for the smollm2 base
    with pytest.raises(ValueError, match="not in this installation"):
        monkeypatch.setenv("DSPEC_ASSETS", str(tmp_path / "empty"))
        dspec.load("smollm2-135m-bd")
    (tmp_path / "assets").mkdir()
    (out / "adapter").rename(tmp_path / "assets" / "smollm2-135m-bd")
    monkeypatch.setenv("DSPEC_ASSETS", str(tmp_path / "assets"))
    monkeypatch.setitem(hub.SHIPPED, "smollm2-135m", lambda: llama)
    model = dspec.load("smollm2-135m-bd")
    assert model.shipped_name == "smollm2-135m-bd" and model.family == "fast_dllm_v2"
    assert model.block_size == 4 and model.mask_token_id == model.tokenizer.token_to_id("<unk>")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not lora_parameters(model)
    # only adapters changed: the frozen base with the adapter's deltas is the loaded model
    base = dspec.load(llama, dtype=torch.float32)
    changed = [
        n
        for n, p in model.named_parameters()
        if n in dict(base.named_parameters()) and not torch.equal(p, dict(base.named_parameters())[n])
    ]
    assert changed and all(n.endswith(("_proj.weight", "embed_tokens.weight")) for n in changed)
    out_tokens = dspec.generate(model, [5, 6, 7], method="diffusion", max_new_tokens=4)
    assert len(out_tokens.tokens) == 4
    # a base with other weights is refused
    monkeypatch.setitem(hub.SHIPPED, "smollm2-135m", lambda: write_checkpoint(tmp_path / "o", "llama", seed=9))
    with pytest.raises(ValueError, match="fingerprint"):
        dspec.load("smollm2-135m-bd")


def test_cli_lora_options(tmp_path, capsys):
    from dspec.train.__main__ import main

    assert main(["tiny-ar", "--out", str(tmp_path / "a"), "--lora-rank", "4", "--max-steps", "1"]) == 2
    assert "lora_rank" in capsys.readouterr().err
    assert main(["bd-adapt", "--init", "tiny-ar", "--out", str(tmp_path / "b"), "--block-sizes", "4,x"]) == 2
    assert "--block-sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--lora-rank" in capsys.readouterr().out

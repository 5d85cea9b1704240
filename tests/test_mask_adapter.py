"""Mask-selective block-diffusion adapters: without a [MASK] token the model is its causal
base bit for bit; with one, only [MASK] rows are adapted, clean queries attend causally, and
the training forward (two streams) equals the inference forward of the 2L layout."""

from __future__ import annotations

import json

import pytest
import torch

import dspec
from conftest import requires_sharegpt
from dspec.models.mask_adapter import MaskAdapter, clean_causal_words
from dspec.models.plan import AttentionPlan
from dspec.ops.masks import pack_mask, unpack_mask
from dspec.train.mask_adapter import (
    frozen_projections_bf16,
    mask_adapter_loss,
    mask_diffusion_model,
    noise_blocks,
    noisy_mask,
    two_stream_logits,
)
from dspec.train.objectives import block_diffusion_mask
from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
MASK = 5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=7)
    return dspec.load(path, dtype="float32")


@pytest.fixture(scope="module")
def bd(base):
    return trained_looking_mask_adapter(base, mask_token_id=MASK)


def _ids(n, seed, lo=10, hi=150):
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_mask_free_forward_is_the_base_bit_for_bit(base, bd, attention):
    seqs = [_ids(23, 1), _ids(9, 2), _ids(17, 3)]
    ref = base(base.plan(seqs), logits="all").logits
    got = bd(bd.plan(seqs, attention=attention, block_size=4), logits="all").logits
    assert torch.equal(got, ref)
    # and with a cache: the prompt committed, then a few clean tokens
    cb, cm = base.new_cache(3), bd.new_cache(3)
    for model, cache, kind in ((base, cb, "causal"), (bd, cm, attention)):
        out = model(model.plan(seqs, cache, attention=kind, block_size=4))
        cache.append(out.suffix_kv, counts=torch.tensor([len(s) for s in seqs]))
    nxt = [_ids(6, 4)] * 3
    a = base(base.plan(nxt, cb)).logits
    b = bd(bd.plan(nxt, cm, attention="block_causal", block_size=4)).logits
    assert torch.equal(a, b)


def test_only_mask_rows_change(base, bd):
    prompt = _ids(13, 5)
    seq = prompt + [MASK, 77, MASK, MASK]
    ref = base(base.plan([seq]), logits="all").logits
    got = bd(bd.plan([seq]), logits="all").logits
    # clean tokens before the first [MASK] are the base's; the [MASK] rows are adapted
    assert torch.equal(got[0, :13], ref[0, :13])
    assert not torch.allclose(got[0, 13], ref[0, 13])
    # a zero adapter with the base's own [MASK] row is the base on the same attention
    fresh = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=2)
    plan = fresh.plan([seq])
    words = clean_causal_words(plan.mask, plan.positions, plan.tokens == MASK, True)
    ref2 = base(AttentionPlan(plan.tokens, plan.positions, words), logits="all").logits
    torch.testing.assert_close(fresh(plan, logits="all").logits, ref2, rtol=1e-5, atol=1e-5)


def test_clean_causal_words_only_removes_visibility():
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(2, 7, 7, generator=g) < 0.6
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 1, 2, 3, 3, 4]])
    is_mask = torch.rand(2, 7, generator=g) < 0.4
    out = unpack_mask(clean_causal_words(pack_mask(dense), pos, is_mask, True), 7)
    want = dense & (is_mask[:, :, None] | (pos[:, None, :] <= pos[:, :, None]))
    assert torch.equal(out, want)
    shared = clean_causal_words(
        None,
        torch.arange(5)[None].expand(3, 5) + torch.tensor([[0], [4], [9]]),
        torch.zeros(3, 5, dtype=torch.bool),
        False,
    )
    assert shared.dim() == 2 and torch.equal(unpack_mask(shared, 5), torch.ones(5, 5, dtype=torch.bool).tril())


def test_two_stream_training_forward_equals_the_inference_forward(bd):
    L, bs = 12, 4
    clean = torch.tensor([_ids(L, 8), _ids(L, 9)])
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, 10:] = False
    noisy, masked = noise_blocks(clean, valid, bs, MASK, torch.Generator().manual_seed(3))
    assert masked.any() and not (masked & ~valid).any()
    index = torch.arange(L).expand(2, L)
    got = two_stream_logits(bd, clean, noisy, valid, bs, index)
    # inference: the 2L layout [noisy ; clean] under the model's own clean-causal rule
    for b in range(2):
        n = int(valid[b].sum())
        tokens = torch.cat([noisy[b, :n], clean[b, :n]])[None]
        pos = torch.cat([torch.arange(n), torch.arange(n)])[None]
        plan = AttentionPlan(tokens, pos, pack_mask(block_diffusion_mask(n, bs)))
        ref = bd(plan, logits="all").logits[0, :n]
        torch.testing.assert_close(got[b, :n], ref, rtol=1e-4, atol=1e-4)
    see = noisy_mask(index, noisy == MASK, valid, bs)
    assert see.shape == (2, L, 2 * L)


def test_loss_trains_only_the_adapter(base):
    model = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=4)
    params = model.mask_adapter.trainable(model)
    assert len(params) == 2 * 7 * 2 + 1
    clean = torch.tensor([_ids(16, 11), _ids(16, 12)])
    valid = torch.ones_like(clean, dtype=torch.bool)
    out = mask_adapter_loss(model, clean, valid, torch.tensor([3, 0]), 4, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(n.endswith(("lora_A", "lora_B")) or n == "mask_adapter.mask_embedding" for n in grads)
    assert any(n.endswith("lora_B") for n in grads) and out.count > 0
    with pytest.raises(ValueError, match="block_size"):
        mask_adapter_loss(model, clean, valid, torch.tensor([0, 0]), 1)


def test_distill_loss_and_agreement(base, bd):
    """distill = a mixes the data CE with KL(base || adapter) at the same slots; the teacher
    is the base model's logits given the true prefix (a causal forward of the clean ids);
    nll_sum stays the data CE; agree counts argmax matches; the KL trains only the adapter."""
    L, bs = 14, 4
    clean = torch.tensor([_ids(L, 31), _ids(L, 32)])
    valid = torch.ones_like(clean, dtype=torch.bool)
    valid[1, 11:] = False
    starts = torch.tensor([2, 0])
    g = lambda: torch.Generator().manual_seed(7)  # same noise per call
    plain = mask_adapter_loss(bd, clean, valid, starts, bs, generator=g())
    assert torch.isnan(plain.agree)
    for a in (0.0, 0.3, 1.0):
        out = mask_adapter_loss(bd, clean, valid, starts, bs, generator=g(), distill=a, agreement=True)
        assert torch.equal(out.nll_sum, plain.nll_sum) and torch.equal(out.count, plain.count)
        # the reference: the masked slots, the student's and the base's logits row by row
        noisy, masked = noise_blocks(clean, valid, bs, MASK, g())
        j = torch.arange(L)
        want = masked & (j % bs != 0) & (j >= starts[:, None])
        student = two_stream_logits(bd, clean, noisy, valid, bs, (j - 1).clamp_min(0).expand(2, L)).float()
        ce, kl, agree = 0.0, 0.0, 0
        for b in range(2):
            n = int(valid[b].sum())
            with torch.no_grad():
                teacher = (
                    base(
                        AttentionPlan(
                            clean[b : b + 1, :n],
                            torch.arange(n)[None],
                            pack_mask(torch.ones(n, n, dtype=torch.bool).tril()),
                        ),
                        logits="all",
                    )
                    .logits[0]
                    .float()
                )
            for i in torch.nonzero(want[b]).flatten().tolist():
                log_q = torch.log_softmax(student[b, i], -1)
                log_p = torch.log_softmax(teacher[i - 1], -1)
                ce += float(-log_q[clean[b, i]])
                kl += float((log_p.exp() * (log_p - log_q)).sum())
                agree += int(student[b, i].argmax() == teacher[i - 1].argmax())
        count = float(want.sum())
        assert float(out.count) == count
        torch.testing.assert_close(float(out.loss), ((1 - a) * ce + a * kl) / count, rtol=1e-4, atol=1e-4)
        assert int(out.agree) == agree
    model = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=4)
    model.mask_adapter.trainable(model)
    mask_adapter_loss(model, clean, valid, starts, bs, generator=g(), distill=1.0).loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(n.endswith(("lora_A", "lora_B")) or n == "mask_adapter.mask_embedding" for n in grads)
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="distill"):
            mask_adapter_loss(bd, clean, valid, starts, bs, distill=bad)


def test_bf16_frozen_projections_train_as_autocast_does(base):
    """Under bf16 autocast the frozen projections held in bf16 give the loss and gradients
    of float32 weights rounded per call, up to the clean stream (float32 matmuls before),
    and leave the adapter, the norms and the embedding in float32."""
    clean = torch.tensor([_ids(16, 21), _ids(16, 22)])
    valid = torch.ones_like(clean, dtype=torch.bool)
    losses, grads = [], []
    for convert in (False, True):
        model = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=4, seed=1)
        params = model.mask_adapter.trainable(model)
        with torch.no_grad():
            for p in params:
                if p.dim() == 2 and p.shape[0] > 4:  # lora_B: nonzero, so A gets a gradient
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
        if convert:
            assert frozen_projections_bf16(model) == 7 * len(model.layers)
            assert all(p.dtype == torch.float32 for p in params)
            assert model.embed_tokens.weight.dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mask_adapter_loss(
                model, clean, valid, torch.tensor([2, 0]), 4, generator=torch.Generator().manual_seed(5)
            )
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert abs(losses[0] - losses[1]) < 0.02 * abs(losses[0])
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos > 0.98, cos


def test_bad_arguments(base):
    with pytest.raises(ValueError, match="mask_token_id"):
        mask_diffusion_model(base, block_size=4, mask_token_id=10**9)
    with pytest.raises(ValueError, match="rank"):
        mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=0)
    model = mask_diffusion_model(base, block_size=4, mask_token_id=MASK)
    with pytest.raises(ValueError, match="already"):
        MaskAdapter.attach(model, rank=2)


def test_adapter_files_round_trip_and_check_the_base(base, bd, tmp_path):
    from dspec.train.lora import base_fingerprint
    from dspec.train.mask_adapter import load_mask_adapter, save_mask_adapter

    save_mask_adapter(
        bd, tmp_path / "a", base_name="tiny-llama", base_fingerprint=base_fingerprint(base), dtype=torch.float32
    )
    again = load_mask_adapter(base, tmp_path / "a")
    seq = [_ids(11, 21) + [MASK, MASK, 40, MASK]]
    with torch.no_grad():
        assert torch.equal(again(again.plan(seq)).logits, bd(bd.plan(seq)).logits)
    other = dspec.load(write_checkpoint(tmp_path / "other", "llama", seed=8), dtype="float32")
    with pytest.raises(ValueError, match="fingerprint"):
        load_mask_adapter(other, tmp_path / "a")
    with pytest.raises(ValueError, match="no dspec-mask-lora-1"):
        load_mask_adapter(base, tmp_path)


def test_warm_start_copies_a_saved_adapter(base, bd, tmp_path):
    from dspec.train.lora import base_fingerprint
    from dspec.train.mask_adapter import init_mask_adapter, save_mask_adapter

    save_mask_adapter(
        bd, tmp_path / "a", base_name="tiny-llama", base_fingerprint=base_fingerprint(base), dtype=torch.float32
    )
    fresh = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=4, seed=3)
    init_mask_adapter(fresh, tmp_path / "a")
    seq = [_ids(9, 5) + [MASK, 33, MASK]]
    with torch.no_grad():
        assert torch.equal(fresh(fresh.plan(seq)).logits, bd(bd.plan(seq)).logits)
    other_rank = mask_diffusion_model(base, block_size=4, mask_token_id=MASK, rank=2)
    with pytest.raises(ValueError, match="rank"):
        init_mask_adapter(other_rank, tmp_path / "a")
    with pytest.raises(ValueError, match="no dspec-mask-lora-1"):
        init_mask_adapter(fresh, tmp_path)


@pytest.mark.parametrize("alpha", [None, 8.0])
def test_warm_start_grows_the_rank_without_changing_the_function(base, bd, tmp_path, alpha):
    from dspec.train.lora import base_fingerprint
    from dspec.train.mask_adapter import init_mask_adapter, save_mask_adapter

    save_mask_adapter(
        bd, tmp_path / "a", base_name="tiny-llama", base_fingerprint=base_fingerprint(base), dtype=torch.float32
    )
    wide = mask_diffusion_model(
        base, block_size=4, mask_token_id=MASK, rank=2 * bd.mask_adapter.rank, alpha=alpha, seed=3
    )
    init_mask_adapter(wide, tmp_path / "a")
    r = bd.mask_adapter.rank
    layer = wide.layers[0].self_attn.q_proj
    assert torch.equal(layer.lora_A[:r], bd.layers[0].self_attn.q_proj.lora_A)
    assert not layer.lora_B[:, r:].any() and layer.lora_A[r:].abs().sum() > 0
    seq = [_ids(9, 5) + [MASK, 33, MASK]]
    with torch.no_grad():
        torch.testing.assert_close(wide(wide.plan(seq)).logits, bd(bd.plan(seq)).logits, atol=1e-5, rtol=1e-5)


@requires_sharegpt
def test_trainer_lowers_the_heldout_loss_and_resumes(tmp_path):
    from dspec.train.data_engine import EngineConfig, GeneratedData, generate_shards
    from dspec.train.mask_adapter import MaskAdapterConfig, MaskAdapterTrainer, main

    tiny = dspec.load("tiny-ar", dtype="float32")
    generate_shards(
        tiny,
        tmp_path / "data",
        EngineConfig(tokens=600, response_tokens=24, prompt_tokens=24, batch=8, shard_batches=2),
        progress=False,
    )
    seqs = GeneratedData(tmp_path / "data").sequences()
    cfg = MaskAdapterConfig(
        rank=4,
        batch_size=4,
        lr=1e-2,
        warmup_steps=2,
        eval_every=1000,
        heldout_sequences=8,
        checkpoint_every_s=1e9,
        autocast="none",
        block_sizes=(2, 4),
        block_weights=(1.0, 1.0),
        eval_block_sizes=(4,),
    )

    def trainer(out):
        model = mask_diffusion_model(tiny, block_size=4, mask_token_id=1, rank=4)
        return MaskAdapterTrainer(model, seqs, cfg, out, base_name="tiny-ar", base_fingerprint="x", progress=False)

    # a later round on grown data holds out only sequences past the earlier count
    import dataclasses

    late = MaskAdapterTrainer(
        mask_diffusion_model(tiny, block_size=4, mask_token_id=1, rank=4),
        seqs,
        dataclasses.replace(cfg, heldout_start=len(seqs) - 20),
        tmp_path / "late",
        base_name="tiny-ar",
        base_fingerprint="x",
        progress=False,
    )
    assert late.heldout and all(h in seqs[-20:] for h in late.heldout) and seqs[0] in late.train_set
    with pytest.raises(ValueError, match="heldout_start"):
        dataclasses.replace(cfg, heldout_start=-1)
    straight = trainer(tmp_path / "a")
    # a few steps on a tiny model: measure on training sequences (learning works at all)
    straight.heldout = straight.train_set[:8]
    before = straight.evaluate()
    straight.train(max_steps=12)
    assert straight.evals[-1]["heldout_loss"] < before - 0.1, (before, straight.evals)
    first = trainer(tmp_path / "b")
    first.train(max_steps=12, steps=5)
    second = trainer(tmp_path / "b")
    second.heldout = first.heldout = straight.heldout
    assert second.resume() and second.step == 5
    second.train(max_steps=12)
    for (n, p), (_, q) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    assert (tmp_path / "a" / "adapter" / "adapter.safetensors").is_file()
    assert (tmp_path / "a" / "adapter" / "loss_curve.png").is_file()
    # the CLI end to end, then the adapter loads on its base
    result = main(
        [
            "--base",
            "tiny-ar",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "cli"),
            "--max-steps",
            "2",
            "--rank",
            "2",
            "--block-sizes",
            "2,4",
            "--block-weights",
            "1,3",
            "--mask-token",
            "<|MASK|>",
            "--autocast",
            "none",
            "--batch-size",
            "2",
        ]
    )
    assert result["step"] == 2
    logged = json.loads((tmp_path / "cli" / "train_log.json").read_text())["config"]
    assert logged["block_sizes"] == [2, 4] and logged["block_weights"] == [1.0, 3.0]
    with pytest.raises(SystemExit):
        main(
            [
                "--base",
                "tiny-ar",
                "--data",
                str(tmp_path / "data"),
                "--out",
                str(tmp_path / "bad"),
                "--block-sizes",
                "2,4",
                "--block-weights",
                "1",
            ]
        )
    from dspec.train.mask_adapter import load_mask_adapter

    model = load_mask_adapter(tiny, tmp_path / "cli" / "adapter")
    assert model.mask_token_id == 1 and model.mask_adapter.rank == 2


def test_hub_loads_a_mask_adapter_on_its_base(base, bd, tmp_path, monkeypatch):
    from dspec import hub
    from dspec.train.lora import base_fingerprint
    from dspec.train.mask_adapter import save_mask_adapter

    ckpt = write_checkpoint(tmp_path / "base", "llama", seed=7)  # the `base` fixture's weights
    save_mask_adapter(
        bd,
        tmp_path / "assets" / "smollm2-135m-bd",
        base_name="smollm2-135m",
        base_fingerprint=base_fingerprint(base),
        dtype=torch.float32,
    )
    monkeypatch.setenv("DSPEC_ASSETS", str(tmp_path / "assets"))
    monkeypatch.setitem(hub.SHIPPED, "smollm2-135m", lambda: ckpt)
    model = dspec.load("smollm2-135m-bd", dtype="float32")
    assert model.shipped_name == "smollm2-135m-bd" and model.config.clean_causal and model.mask_adapter is not None
    seq = [_ids(9, 30)]
    with torch.no_grad():
        assert torch.equal(model(model.plan(seq)).logits, base(base.plan(seq)).logits)
    ar = dspec.generate(base, seq[0], method="ar", max_new_tokens=6).tokens
    assert dspec.generate(model, seq[0], method="diffusion", block_size=1, max_new_tokens=6).tokens == ar
    assert dspec.generate(model, seq[0], method="s2d2", block_size=4, policy="always", max_new_tokens=6).tokens == ar
    assert "smollm2-135m-bd" in hub.available_models()


def test_s2d2_redraft_blocks_share_the_chain_rows(tmp_path, monkeypatch):
    """On a model whose clean rows attend causally the redraft blocks keep only their own
    rows and read the chain's before them: their drafts (the next block's, and the boundary
    state's after a rejected last draft) are still those of plain drafting forwards of the
    states they stand for (float32)."""
    from s2d2_cases import redraft_checks

    base = dspec.load(write_checkpoint(tmp_path, "llama", seed=0, hidden=256, inter=768, layers=4))
    model = trained_looking_mask_adapter(base, mask_token_id=MASK)
    done = redraft_checks(
        model, [_ids(3, 3), _ids(9, 9), _ids(70, 70), _ids(30, 30)], monkeypatch, max_new_tokens=48, boundary=True
    )
    assert done["reuse"] > 0 and done["next"] > 0 and done["boundary"] > 0


@pytest.mark.parametrize("boundary", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_s2d2_caches_the_bases_kv_bit_for_bit(tmp_path, dtype, boundary):
    """Greedy ``s2d2`` (policy always) on a mask-adapted model leaves in its cache exactly the
    keys and values one causal forward of the base computes over the same tokens: a block its
    drafts complete is committed from the verified chain, whose rows sit at the key indices of
    their positions (the speculative block's rows, after the chain, round differently) -- also
    a block the boundary state finished, committed behind the next verification's chain."""
    from dspec.decode import s2d2

    base = dspec.load(write_checkpoint(tmp_path, "llama", seed=0, hidden=256, inter=768, layers=4), dtype=dtype)
    model = trained_looking_mask_adapter(base, mask_token_id=MASK)
    prompts = [_ids(3, 3), _ids(9, 9), _ids(70, 70), _ids(30, 30)]
    opt = s2d2.resolve_options(model, None, None, "always", None, None, None, None, None, None, boundary=boundary)
    with torch.no_grad():
        run = s2d2.S2D2Run(
            model, prompts, opt, max_new_tokens=64, temperature=0.0, generator=None, eos_ids=(), progress=None
        )
        while run.step():
            pass
        assert run.stats()["spec_block_commits"] > 0
        assert (run.stats()["boundary_drafts"] > 0) == boundary
        # a tiny base can write the [MASK] id itself (a real one never does): not comparable
        rows = [b for b in range(len(prompts)) if MASK not in run.generated[b]]
        assert len(rows) >= 2
        for b in rows:
            seq = prompts[b] + run.generated[b]
            cache = base.new_cache(1)
            plan = base.plan([seq], cache)
            cache.append(base(plan, logits=None).suffix_kv, counts=plan.lengths)
            # every block is committed but maybe the last (nothing reads it)
            n = min(int(run.cache.lengths[b]), len(seq))
            assert n >= len(seq) - 2 * model.block_size
            for layer in range(base.config.num_layers):
                k, v = cache.layer_rows(layer)
                assert torch.equal(k[:n], run.cache.k[layer, b, :n]), (b, layer)
                assert torch.equal(v[:n], run.cache.v[layer, b, :n]), (b, layer)


def test_s2d2_boundary_state_samples_the_block_size_one_law(tmp_path):
    """Frequency test across a block boundary (T = 1, redraft blocks with the boundary state):
    two sampled slots end a block -- a rejected last draft finishes it, and the next block's
    first draft comes from the boundary state (a proposal that has not seen the drawn token),
    verified behind the finished block -- and the next block's first slot follows.  Each
    slot's counts follow the block-size-1 law given the sampled slots before it (the mean of
    the base model's conditionals over the samples)."""
    import math

    base_model = dspec.load(write_checkpoint(tmp_path, "llama", seed=3, vocab=64), dtype="float32")
    model = trained_looking_mask_adapter(base_model, mask_token_id=MASK)
    vocab, n, bs = model.config.vocab_size, 12000, model.block_size
    prompt = [11, 23, 35, 47, 9, 14]  # block 1: two prompt slots, two to decode
    assert len(prompt) % bs == 2
    from dspec.decode.s2d2 import decode_s2d2

    tokens, stats = decode_s2d2(
        model,
        [prompt] * n,
        max_new_tokens=3,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
        eos_ids=(),
        policy="always",
        redraft=True,
        boundary=True,
    )  # no EOS: every sample has 3 slots
    assert stats["boundary_drafts"] > n // 10  # the boundary path carries many samples
    x = torch.tensor(tokens)
    assert x.shape == (n, 3)

    def conditional_law(slot):
        """Mean over the samples of p(x_slot | prompt, x_<slot) (block-size-1 = the base)."""
        if slot == 0:
            prefixes, inverse = x[:1, :0], torch.zeros(n, dtype=torch.int64)
        else:
            prefixes, inverse = torch.unique(x[:, :slot], dim=0, return_inverse=True)
        seqs = [prompt + p.tolist() for p in prefixes]
        cache = base_model.new_cache(len(seqs))
        logits = base_model(base_model.plan(seqs, cache), logits="last").logits[:, 0].double()
        laws = torch.softmax(logits, -1)
        return laws[inverse].mean(0)

    for slot in range(3):
        counts = torch.bincount(x[:, slot], minlength=vocab).double()
        law = conditional_law(slot)
        big = law * n >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([law[big] * n, law[~big].sum()[None] * n])
        keep = exp > 0
        stat, dof = float(((obs - exp)[keep] ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
        assert stat < dof + 6 * math.sqrt(2 * dof), (slot, stat, dof)


@pytest.mark.parametrize(
    "policy, extra", [("always", {}), ("min_span", {"min_span": 2}), ("hysteresis", {"hysteresis": (1.0, 0.3)})]
)
def test_s2d2_boundary_state_batch_equals_single_runs(tmp_path, policy, extra):
    """With the boundary state rows in every phase share each forward -- a verification
    behind its pending block beside drafting rows and plain verifications -- and each
    request decodes what it decodes alone (float32, greedy); a router that does not verify
    a boundary row's drafts (they are proposals, not a diffusion state) takes a drafting
    forward behind the pending block instead."""
    base_model = dspec.load(write_checkpoint(tmp_path, "llama", seed=0, hidden=256, inter=768, layers=4))
    model = trained_looking_mask_adapter(base_model, mask_token_id=MASK)
    prompts = [_ids(3, 3), _ids(9, 9), _ids(70, 70), _ids(30, 30)]
    kw = dict(method="s2d2", max_new_tokens=40, policy=policy, redraft=True, boundary=True, threshold=0.9, **extra)
    batch = dspec.generate(model, prompts, **kw)
    singles = [dspec.generate(model, p, **kw) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles]
    assert sum(g.stats["boundary_drafts"] for g in singles) > 0

"""Drafter training recipes (dspec.train.dflash, dspec.train.vp_drafter): the loss goes down,
the VP prefix prior and loss weights follow their formulas, resume is exact, the CLI runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dspec
from dspec.decode.ar import decode_ar
from dspec.models.dflash import MASK, block_loss_weights, load_drafter
from dspec.train.dflash import (
    DrafterTrainConfig,
    DrafterTrainer,
    ban_tokens,
    block_loss,
    greedy_accepted,
    main,
    make_blocks,
    pad_sequences,
    rejection_prefixes,
    target_hidden,
)
from dspec.train.vp_drafter import main as vp_main, prefix_prior, prefix_sampler, sample_prefix_lengths
from tiny_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama", seed=4)
    return path


@pytest.fixture(scope="module")
def target(ckpt):
    return dspec.load(ckpt)


@pytest.fixture(scope="module")
def sequences(target):
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, 150, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(48)
    ]
    out, _ = decode_ar(target, prompts, max_new_tokens=20)
    return [(p + o, len(p)) for p, o in zip(prompts, out)]


def small_cfg(**kw):
    base = dict(
        block_size=4,
        batch_size=8,
        anchors_per_seq=4,
        warmup_steps=3,
        lr=3e-3,
        min_lr=3e-4,
        eval_every=1000,
        max_steps=40,
        checkpoint_every_s=1e9,
    )
    base.update(kw)
    return DrafterTrainConfig(**base)


def test_prefix_prior_formula_and_sampling():
    a, n = 0.6, 5
    p = prefix_prior(n, a)
    expect = torch.tensor([a**i * (1 - a) for i in range(n)], dtype=torch.float64)
    torch.testing.assert_close(p, expect / expect.sum())
    g = torch.Generator().manual_seed(0)
    draws = sample_prefix_lengths(g, (200, 100), n, a)
    assert draws.shape == (200, 100) and int(draws.min()) >= 0 and int(draws.max()) <= n - 1
    freq = torch.bincount(draws.flatten(), minlength=n).double() / draws.numel()
    assert torch.allclose(freq, p, atol=0.01)
    for bad in ((0, 0.5), (3, 1.0), (3, 0.0)):
        with pytest.raises(ValueError):
            prefix_prior(*bad)


def test_blocks_and_weights_follow_the_formula():
    tokens, lengths, plens = pad_sequences([(list(range(10, 22)), 4), (list(range(30, 37)), 2)], "cpu")
    prefix = torch.tensor([[0, 2, 3], [1, 0, 2]])
    g = torch.Generator().manual_seed(1)
    blocks, labels, valid, starts, pre = make_blocks(
        tokens, lengths, plens, block_size=5, anchors=3, prefix_lengths=prefix, generator=g
    )
    assert blocks.shape == labels.shape == valid.shape == (2, 3, 5)
    assert bool((starts >= plens[:, None]).all()) and bool((starts <= lengths[:, None] - 2).all())
    j = torch.arange(5)
    for b in range(2):
        for m in range(3):
            s, i = int(starts[b, m]), int(prefix[b, m])
            for slot in range(5):
                inside = s + slot < int(lengths[b])
                if slot <= i and inside:
                    assert blocks[b, m, slot] == tokens[b, s + slot]  # anchor + given prefix
                else:
                    assert blocks[b, m, slot] == MASK
                assert bool(valid[b, m, slot]) == (slot > i and inside)
                if inside:
                    assert labels[b, m, slot] == tokens[b, s + slot]
    w = block_loss_weights(5, pre, 2.0)
    expect = torch.where(j > pre[..., None], torch.exp(-(j - pre[..., None] - 1) / 2.0), torch.zeros(()))
    torch.testing.assert_close(w, expect.float())
    assert w[0, 1].tolist() == pytest.approx([0, 0, 0, 1, math.exp(-0.5)])


@pytest.mark.parametrize("kind", ["dflash", "vp"])
def test_training_lowers_the_loss(target, sequences, tmp_path, kind):
    cfg = small_cfg(kind=kind)
    trainer = DrafterTrainer(
        target,
        cfg,
        tmp_path,
        sequences=sequences,
        progress=False,
        prefix_sampler=prefix_sampler(cfg) if kind == "vp" else None,
    )
    # a random target's continuations are not learnable from 48 sequences: measure the
    # loss on training sequences (the recipe's held-out loss is what the model cards report)
    trainer.held_idx = trainer.train_idx[:16]
    before = trainer.evaluate()
    result = trainer.train(max_steps=40)
    assert result["step"] == 40
    assert result["heldout_loss"] < before - 0.5, (before, result)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert len(log["train"]) == 40 and log["heldout"][-1]["heldout_loss"] == result["heldout_loss"]
    assert (tmp_path / "loss_curve.png").is_file()


def test_resume_is_exact(target, sequences, tmp_path):
    cfg = small_cfg(kind="vp", max_steps=6)
    straight = DrafterTrainer(
        target, cfg, tmp_path / "a", sequences=sequences, progress=False, prefix_sampler=prefix_sampler(cfg)
    )
    straight.train(max_steps=6)
    first = DrafterTrainer(
        target, cfg, tmp_path / "b", sequences=sequences, progress=False, prefix_sampler=prefix_sampler(cfg)
    )
    first.train(max_steps=6, steps=3)
    assert first.step == 3
    second = DrafterTrainer(
        target, cfg, tmp_path / "b", sequences=sequences, progress=False, prefix_sampler=prefix_sampler(cfg)
    )
    assert second.resume() and second.step == 3
    second.train(max_steps=6)
    assert second.step == 6
    for (k, v), (_, w) in zip(straight.drafter.state_dict().items(), second.drafter.state_dict().items()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)


def test_cli_writes_a_loadable_drafter(ckpt, target, tmp_path):
    out = tmp_path / "run"
    result = main(
        [
            "--target",
            str(ckpt),
            "--out",
            str(out),
            "--max-steps",
            "3",
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
            "--weight-decay",
            "0.05",
        ]
    )
    assert result["step"] == 3
    assert json.loads((out / "train_log.json").read_text())["config"]["weight_decay"] == 0.05
    d = load_drafter(out / "drafter", target, kind="dflash")
    assert d.block_size == 4
    card = (out / "drafter" / "README.md").read_text()
    assert "held-out loss" in card and "acceptance" in card
    with pytest.raises(SystemExit):
        main(["--target", str(ckpt), "--out", str(out), "--max-steps", "3"])  # exists, no --resume
    with pytest.raises(SystemExit, match="weight-decay"):
        main(["--target", str(ckpt), "--out", str(tmp_path / "wd"), "--weight-decay", "-1"])


def test_warm_start_from_a_saved_drafter(ckpt, target, sequences, tmp_path):
    """--init: a VP run starts from a DFlash drafter's weights; a shape mismatch is refused."""
    cfg = small_cfg(max_steps=3)
    src = DrafterTrainer(target, cfg, tmp_path / "src", sequences=sequences, progress=False)
    src.train(max_steps=3)
    src.drafter.save(tmp_path / "dflash")
    vp_cfg = small_cfg(kind="vp", max_steps=3, seed=5)
    vp = DrafterTrainer(
        target, vp_cfg, tmp_path / "vp", sequences=sequences, progress=False, prefix_sampler=prefix_sampler(vp_cfg)
    )
    vp.init_from(tmp_path / "dflash")
    for (k, v), (_, w) in zip(src.drafter.state_dict().items(), vp.drafter.state_dict().items()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)
    assert vp.data_info["init"] == str(tmp_path / "dflash")
    other = DrafterTrainer(target, small_cfg(block_size=6), tmp_path / "other", sequences=sequences, progress=False)
    with pytest.raises(ValueError, match="block_size"):
        other.init_from(tmp_path / "dflash")


def test_warm_start_deepens_a_shallower_drafter(target, sequences, tmp_path):
    """--init with --layers above the saved drafter's: its layers first, the added ones the
    identity (the logits are unchanged at step 0), and they then train; deeper sources fail."""
    src = DrafterTrainer(target, small_cfg(max_steps=3), tmp_path / "src", sequences=sequences, progress=False)
    src.train(max_steps=3)
    src.drafter.save(tmp_path / "one")
    deep = DrafterTrainer(
        target, small_cfg(max_steps=3, num_layers=2, seed=7), tmp_path / "deep", sequences=sequences, progress=False
    )
    deep.init_from(tmp_path / "one")
    assert deep.data_info["init_layers"] == 1
    mine = deep.drafter.state_dict()
    for k, v in src.drafter.state_dict().items():
        torch.testing.assert_close(mine[k], v, rtol=0, atol=0, msg=k)
    assert not deep.drafter.layers[1].o_proj.weight.any() and not deep.drafter.layers[1].mlp.down_proj.weight.any()
    hidden = [torch.randn(2, 9, target.config.hidden_size) for _ in src.drafter.target_layer_ids]
    blocks = torch.tensor([[[3, MASK, MASK, MASK], [5, MASK, MASK, MASK]]] * 2)
    starts = torch.tensor([[2, 6]] * 2)
    with torch.no_grad():
        torch.testing.assert_close(
            deep.drafter.forward_train(hidden, blocks, starts), src.drafter.forward_train(hidden, blocks, starts)
        )
    deep.train(max_steps=3)
    assert deep.drafter.layers[1].o_proj.weight.any()
    src2 = DrafterTrainer(
        target, small_cfg(max_steps=3, num_layers=2), tmp_path / "src2", sequences=sequences, progress=False
    )
    src2.drafter.save(tmp_path / "two")
    with pytest.raises(ValueError, match="num_layers = 2"):
        src.init_from(tmp_path / "two")


def test_new_weight_oversamples_the_appended_sequences(target, sequences, tmp_path):
    """``new_weight = w``: each training sequence from ``heldout_start`` on appears w times in
    the list a step draws from uniformly; the held-out split and the earlier sequences are
    unchanged."""
    one = DrafterTrainer(target, small_cfg(heldout_start=30), tmp_path / "one", sequences=sequences, progress=False)
    three = DrafterTrainer(
        target, small_cfg(heldout_start=30, new_weight=3), tmp_path / "three", sequences=sequences, progress=False
    )
    assert three.held_idx == one.held_idx and min(one.held_idx) >= 30
    counts = {i: three.train_idx.count(i) for i in set(three.train_idx)}
    assert set(counts) == set(one.train_idx)
    assert all(c == (3 if i >= 30 else 1) for i, c in counts.items())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="new_weight"):
            small_cfg(new_weight=bad)


def test_greedy_accepted_counts_the_leading_agreeing_drafts():
    labels = torch.tensor([[[7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 3, 4]]])
    preds = torch.tensor([[[0, 1, 2, 9, 4], [0, 9, 2, 3, 4], [0, 1, 2, 3, 4], [0, 0, 2, 3, 9]]])
    valid = torch.ones_like(labels, dtype=torch.bool)
    valid[0, 2, 4] = False  # block 2 runs past the sequence end
    valid[..., 0] = False  # the anchor is given
    prefix = torch.tensor([[0, 0, 0, 1]])  # block 3: slot 1 given (VP)
    valid[0, 3, 1] = False
    logits = torch.nn.functional.one_hot(preds, 10).float()
    acc, correct = greedy_accepted(logits, labels, valid, prefix)
    assert acc.tolist() == [[2, 0, 3, 2]]
    assert correct[0, 0].tolist() == [False, True, True, False, True] and not correct[0, 2, 4]
    # logits over a draft vocabulary: column j drafts draft_ids[j]
    draft_ids = torch.tensor([9, 4, 3, 2, 1, 0, 5, 6, 7, 8])
    column = torch.argsort(draft_ids)[preds]
    acc2, _ = greedy_accepted(torch.nn.functional.one_hot(column, 10).float(), labels, valid, prefix, draft_ids)
    assert torch.equal(acc, acc2)


def test_draft_vocab_training_reads_only_its_columns(target, sequences, tmp_path):
    """cfg.draft_vocab: the drafter trains over the most frequent response ids; slots labelled
    outside weigh 0, the loss equals a softmax over those columns; the saved drafter keeps them."""
    cfg = small_cfg(draft_vocab=12, max_steps=4)
    trainer = DrafterTrainer(target, cfg, tmp_path, sequences=sequences, progress=False)
    ids = trainer.drafter.draft_vocab
    assert ids.numel() == 12 and set(target.eos_token_ids) <= set(ids.tolist())
    tokens, lengths, blocks, labels, valid, starts, prefix, hidden, banned = trainer.batch(0)
    assert banned is None
    loss, total, logits = block_loss(
        trainer.drafter,
        target,
        tokens,
        lengths,
        blocks,
        labels,
        valid,
        starts,
        prefix,
        cfg.decay,
        hidden,
        draft_index=trainer.draft_index,
        return_logits=True,
    )
    assert logits.shape[-1] == 12
    full = trainer.drafter.forward_train(
        target(
            target.plan(tokens), logits=None, hidden_states=trainer.drafter.target_layer_ids, return_kv=False
        ).hidden,
        blocks,
        starts,
        context_length=lengths,
    )
    torch.testing.assert_close(logits, full[..., ids], rtol=1e-5, atol=1e-5)
    inside = torch.isin(labels, ids) & valid
    w = block_loss_weights(blocks.shape[-1], prefix, cfg.decay) * inside
    col = trainer.draft_index[labels].clamp_min(0)
    ce = -torch.log_softmax(full[..., ids].float(), -1).gather(-1, col[..., None])[..., 0]
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum(), rtol=1e-5, atol=1e-5)
    assert float(total) == pytest.approx(float(w.sum()))
    # banning column 0 everywhere: a weight-0 slot (label outside, clamped to column 0) must not
    # turn the loss into inf * 0 = nan; weighted slots keep their value unless banned themselves
    everywhere = torch.full(prefix.shape, int(ids[0]))
    banned_loss, banned_total = block_loss(
        trainer.drafter,
        target,
        tokens,
        lengths,
        blocks,
        labels,
        valid,
        starts,
        prefix,
        cfg.decay,
        hidden,
        draft_index=trainer.draft_index,
        banned=everywhere,
    )
    assert float(banned_total) == pytest.approx(float(w.sum()))
    at_ban = torch.arange(blocks.shape[-1]) == (prefix + 1)[..., None]
    if not bool((at_ban & (labels == ids[0]) & inside).any()):
        assert torch.isfinite(banned_loss)
    trainer.train(max_steps=4)
    rec = trainer.evals[-1]
    assert 1.0 <= rec["heldout_accepted"] <= cfg.block_size and len(rec["slot_accuracy"]) == cfg.block_size - 1
    trainer.drafter.save(tmp_path / "saved")
    assert torch.equal(load_drafter(tmp_path / "saved", target).draft_vocab, ids)


# ------------------------------------------------------------------ VP prefixes at DFlash's rejections


def test_ban_tokens_removes_one_logit_at_the_first_redrafted_slot():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, 7, generator=gen)
    prefix = torch.tensor([[0, 2, 3], [1, 0, 0]])
    banned = torch.tensor([[4, 6, -1], [0, 2, 5]])
    out = ban_tokens(logits, prefix, banned)
    expect = logits.clone()
    for b in range(2):
        for m in range(3):
            if banned[b, m] >= 0:
                expect[b, m, prefix[b, m] + 1, banned[b, m]] = float("-inf")
    assert torch.equal(out, expect)
    # over a draft vocabulary: the banned id's column; an id outside it bans nothing
    draft_index = torch.full((20,), -1)
    draft_ids = torch.tensor([11, 4, 9, 0, 13, 2, 7])
    draft_index[draft_ids] = torch.arange(7)
    banned_ids = torch.where(banned >= 0, draft_ids[banned.clamp_min(0)], -1)
    banned_ids[1, 2] = 19  # outside the draft vocabulary
    expect[1, 2, 1, 5] = logits[1, 2, 1, 5]
    assert torch.equal(ban_tokens(logits, prefix, banned_ids, draft_index), expect)


def test_rejection_prefixes_match_a_per_block_loop(target, sequences):
    """prefix = the first draft's leading correct slots, rejected = its token at the next
    slot, has = that slot lies inside the sequence; against a plain per-block loop."""
    cfg = small_cfg(max_steps=3, block_size=5, anchors_per_seq=6)
    first = DrafterTrainer(target, cfg, "/tmp/unused-first", sequences=sequences, progress=False).drafter.eval()
    rows = sequences[:6]
    tokens, lengths, plens = pad_sequences(rows, target.device)
    g = torch.Generator().manual_seed(3)
    blocks, labels, valid, starts, _ = make_blocks(tokens, lengths, plens, block_size=5, anchors=6, generator=g)
    hidden = target_hidden(target, tokens, first.target_layer_ids)
    prefix, rejected, has = rejection_prefixes(first, hidden, lengths, blocks, labels, valid, starts)
    with torch.no_grad():
        draft = first.forward_train(hidden, blocks, starts, context_length=lengths).argmax(-1)
    seen = 0
    for b in range(6):
        for m in range(6):
            n = 0
            while n < 4 and valid[b, m, n + 1] and draft[b, m, n + 1] == labels[b, m, n + 1]:
                n += 1
            inside = n < 4 and bool(valid[b, m, n + 1])
            assert bool(has[b, m]) == inside
            assert int(prefix[b, m]) == min(n, 3)
            if inside:
                seen += 1
                assert int(rejected[b, m]) == int(draft[b, m, n + 1]) != int(labels[b, m, n + 1])
    assert seen > 0


def test_rejection_mode_trains_on_the_first_drafters_rejections(target, sequences, tmp_path):
    """prefix_mode='rejection': blocks given up to the first draft's rejection, the rejected
    draft banned, rejection-free blocks weigh 0; the loss falls; config and drafter are checked."""
    first = DrafterTrainer(target, small_cfg(max_steps=3), tmp_path / "first", sequences=sequences, progress=False)
    first.train(max_steps=3)
    cfg = small_cfg(kind="vp", prefix_mode="rejection")
    trainer = DrafterTrainer(
        target, cfg, tmp_path / "vp", sequences=sequences, progress=False, first_drafter=first.drafter
    )
    tokens, lengths, blocks, labels, valid, starts, prefix, hidden, banned = trainer.batch(0)
    j = torch.arange(cfg.block_size)
    inside = starts[..., None] + j < lengths[:, None, None]
    given = (j <= prefix[..., None]) & inside
    assert torch.equal(blocks, torch.where(given, labels, torch.full_like(labels, MASK)))
    assert not valid[banned < 0].any() and valid[banned >= 0].any()
    assert ((j > prefix[..., None]) | ~valid).all()
    at = (prefix + 1).clamp_max(cfg.block_size - 1)[..., None]
    assert (labels.gather(-1, at)[..., 0] != banned)[banned >= 0].all()
    trainer.held_idx = trainer.train_idx[:16]
    before = trainer.evaluate()
    trainer.train(max_steps=40)
    rec = trainer.evals[-1]
    assert rec["heldout_loss"] < before and 0 < rec["rejected_fraction"] <= 1
    assert 1.0 <= rec["heldout_accepted"] <= cfg.block_size
    with pytest.raises(ValueError, match="first_drafter"):
        DrafterTrainer(target, cfg, tmp_path / "none", sequences=sequences, progress=False)
    with pytest.raises(ValueError, match="block size"):
        DrafterTrainer(
            target,
            small_cfg(kind="vp", prefix_mode="rejection", block_size=6),
            tmp_path / "bs",
            sequences=sequences,
            progress=False,
            first_drafter=first.drafter,
        )
    with pytest.raises(ValueError, match="kind must be 'vp'"):
        small_cfg(prefix_mode="rejection")
    with pytest.raises(ValueError, match="prefix_mode"):
        small_cfg(kind="vp", prefix_mode="boundary")


def test_vp_cli_rejection_mode(ckpt, target, tmp_path):
    first = tmp_path / "first"
    main(
        [
            "--target",
            str(ckpt),
            "--out",
            str(first),
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
        ]
    )
    out = tmp_path / "vp"
    result = vp_main(
        [
            "--target",
            str(ckpt),
            "--out",
            str(out),
            "--max-steps",
            "2",
            "--data",
            str(first / "data.pt"),
            "--block-size",
            "4",
            "--batch-size",
            "4",
            "--prefix",
            "rejection",
            "--dflash-drafter",
            str(first / "drafter"),
        ]
    )
    assert result["step"] == 2
    log = json.loads((out / "train_log.json").read_text())
    assert log["config"]["prefix_mode"] == "rejection" and log["data"]["rejections_of"] == str(first / "drafter")
    assert "first rejection" in (out / "drafter" / "README.md").read_text()
    load_drafter(out / "drafter", target, kind="vp")

"""dspec.train: tokenizer, block-diffusion objective, training forward == inference forward,
a short training run, exact resume, the CLI."""

import pytest
import torch

import dspec
from dspec import pack_mask, tasks
from dspec.models import AttentionPlan, Model
from dspec.models.config import parse_config
from dspec.train import (
    DataSpec,
    PackedData,
    TrainConfig,
    Trainer,
    block_diffusion_batch,
    block_diffusion_loss,
    block_diffusion_mask,
    causal_lm_loss,
    lr_at,
    pack_rows,
    save_tokenizer,
    tiny_config,
    train_forward,
    train_tokenizer,
)
from dspec.train.objectives import causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def corpus():
    text = [p.prompt + p.answer for p in tasks.arithmetic(300, seed=1000)]
    text += [
        "def add(a, b):\n    return a + b\n",
        "Hello, how are you? I am fine, thank you.",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    ] * 20
    return text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(corpus(), vocab_size=400)
    path = save_tokenizer(tok, tmp_path_factory.mktemp("tok"))
    return dspec.models.Tokenizer.from_dir(path)


def small_model(family, vocab, seed=0):
    raw = tiny_config(
        family,
        SMALL,
        vocab_size=vocab,
        eos_token_id=0,
        pad_token_id=2,
        mask_token_id=1 if family == "sdar" else None,
        block_size=4 if family == "sdar" else None,
    )
    return Model(parse_config(raw)).init_random_(0.1, seed=seed)


def small_data(tokenizer, seq_len=32, rows=64):
    docs = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in corpus()]
    import random

    train = pack_rows(docs, seq_len, rows, random.Random(0))
    held = pack_rows(docs, seq_len, 4, random.Random(1))
    return PackedData(train, torch.zeros(rows, dtype=torch.int8), {"arithmetic": held}, seed=0)


# ------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(tokenizer, tmp_path):
    assert (tokenizer.eos_token_id, tokenizer.mask_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert 259 < tokenizer.vocab_size <= 400  # small corpus: fewer merges than asked
    for text in ["Compute: 37 + 48 = 85", "def f(x):\n\treturn x  # ünïcode ✓\n", "  spaces   "]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    # digits are single tokens: numbers are spelled digit by digit
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("1234")] == list("1234")
    assert tokenizer.decode([1, 0] + tokenizer.encode("ab")) == "ab"  # specials dropped
    again = train_tokenizer(corpus(), vocab_size=400)  # deterministic
    assert again.to_str() == tokenizer.inner.to_str()
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(corpus(), vocab_size=10)


# ------------------------------------------------------------------------- objective


@pytest.mark.parametrize("length,block", [(8, 1), (8, 4), (10, 4), (7, 16), (12, 3)])
def test_block_diffusion_mask_is_the_definition(length, block):
    got = block_diffusion_mask(length, block)
    want = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    for i in range(2 * length):
        for j in range(2 * length):
            bi, bj = (i % length) // block, (j % length) // block
            qi_noisy, kj_noisy = i < length, j < length
            if qi_noisy:
                want[i, j] = (bj == bi) if kj_noisy else (bj < bi)
            else:
                want[i, j] = (not kj_noisy) and bj <= bi
    assert torch.equal(got, want)
    if block == 1:  # noisy i sees clean < i and itself: a causal LM with [MASK] queries
        assert torch.equal(got[:length, length:], causal_mask(length) & ~torch.eye(length, dtype=torch.bool))


@pytest.mark.parametrize("block", [1, 3, 4, 8])
def test_block_diffusion_noise(block):
    tokens = torch.randint(3, 50, (64, 10))
    gen = torch.Generator().manual_seed(0)
    b = block_diffusion_batch(tokens, block, 1, generator=gen)
    assert torch.equal(b.inputs[:, 10:], tokens)
    assert torch.equal(b.inputs[:, :10] == 1, b.masked)
    assert torch.equal(b.inputs[:, :10][~b.masked], tokens[~b.masked])
    for start in range(0, 10, block):
        size = min(block, 10 - start)
        k = b.masked[:, start : start + size].sum(1)
        assert int(k.min()) >= 1 and int(k.max()) <= size  # never an empty block
        assert torch.allclose(b.ratio[:, start], k.float() / size)
        if size > 1:
            assert int(k.max()) == size and int(k.min()) == 1  # k spans 1..size
    if block == 1:
        assert bool(b.masked.all())


def test_block_size_one_loss_is_causal_with_mask_queries():
    """At block size 1 every noisy token is [MASK] seeing the clean prefix: the loss is the
    position-aligned autoregressive NLL."""
    model = small_model("sdar", 60, seed=3)
    tokens = torch.randint(3, 60, (2, 9))
    got = block_diffusion_loss(model, tokens, 1, 1)
    # reference: each position j from [tokens < j, MASK at j], causal, at position j
    nll = 0.0
    for b in range(2):
        for j in range(9):
            seq = torch.cat([tokens[b, :j], torch.tensor([1])])[None]
            logits = train_forward(model, seq, torch.arange(j + 1), is_causal=True)[0, -1]
            nll += float(torch.nn.functional.cross_entropy(logits[None], tokens[b, j : j + 1]).detach())
    assert got.count == 18
    assert abs(float(got.loss.detach()) - nll / 18) < 1e-4


# ------------------------------------------------------------------------- training forward


def test_training_forward_equals_inference_forward():
    model = small_model("sdar", 80, seed=1)
    tokens = torch.randint(3, 80, (2, 12))
    b = block_diffusion_batch(tokens, 4, 1, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        train = train_forward(model, b.inputs, b.positions, b.mask)
        plan = AttentionPlan(b.inputs, b.positions[None].expand(2, -1), pack_mask(b.mask))
        infer = model(plan).logits
        assert torch.allclose(train, infer, atol=2e-5, rtol=1e-4)
        # decoding's view of noisy block 1: clean block 0 in the KV cache, block 1 as suffix
        cache = model.new_cache(2)
        out = model(model.plan(tokens[:, :4], cache))
        cache.append(out.suffix_kv)
        step = model(
            AttentionPlan(
                b.inputs[:, 4:8], torch.arange(4, 8).expand(2, -1), dspec.masks.block_diffusion(4).words, cache
            )
        ).logits
        assert torch.allclose(train[:, 4:8], step, atol=2e-5, rtol=1e-4)
    causal = small_model("qwen3", 80, seed=2)
    with torch.no_grad():
        train = train_forward(causal, tokens, torch.arange(12), is_causal=True)
        dense = train_forward(causal, tokens, torch.arange(12), causal_mask(12))
        infer = causal(causal.plan(tokens)).logits
    assert torch.allclose(train, infer, atol=2e-5, rtol=1e-4)
    assert torch.allclose(dense, infer, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------- trainer


@pytest.mark.parametrize("objective", ["causal", "block_diffusion"])
def test_twenty_steps_lower_the_loss(tokenizer, tmp_path, objective):
    torch.manual_seed(0)
    data = small_data(tokenizer)
    family = "qwen3" if objective == "causal" else "sdar"
    model = small_model(family, tokenizer.vocab_size)
    cfg = TrainConfig(
        objective=objective,
        batch_size=8,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=3,
        max_steps=20,
        eval_every=0,
        block_sizes=(1, 4),
        eval_block_sizes=(1,),
        checkpoint_every_s=1e9,
    )
    trainer = Trainer(model, data, cfg, tmp_path, mask_token_id=1, plot=objective == "causal")
    before = trainer.evaluate()
    after = trainer.train(progress=False)
    key = "arithmetic" if objective == "causal" else "arithmetic/bs1"
    assert after[key]["nats_per_token"] < before[key]["nats_per_token"] - 0.5
    assert trainer.step == 20 and (tmp_path / "checkpoint.pt").is_file()
    assert (tmp_path / "train_log.json").is_file()
    assert (tmp_path / "loss_curve.png").is_file() == (objective == "causal")


def test_resume_continues_identically(tokenizer, tmp_path):
    data = small_data(tokenizer)
    cfg = TrainConfig(
        objective="block_diffusion",
        batch_size=4,
        micro_batch_size=2,
        lr=5e-3,
        min_lr=5e-4,
        warmup_steps=2,
        max_steps=6,
        eval_every=0,
        block_sizes=(1, 2, 4),
        checkpoint_every_s=1e9,
    )
    straight = Trainer(
        small_model("sdar", tokenizer.vocab_size), data, cfg, tmp_path / "a", mask_token_id=1, plot=False
    )
    straight.train(progress=False)
    first = Trainer(small_model("sdar", tokenizer.vocab_size), data, cfg, tmp_path / "b", mask_token_id=1, plot=False)
    first.train(max_steps=3, progress=False)
    second = Trainer(
        small_model("sdar", tokenizer.vocab_size, seed=9), data, cfg, tmp_path / "b", mask_token_id=1, plot=False
    )
    assert second.resume() and second.step == 3
    second.train(progress=False)
    assert second.step == straight.step == 6
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, second.model.state_dict()[k]), k
    assert [r["loss"] for r in second.log] == [r["loss"] for r in straight.log]


def test_schedule_and_config_checks():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg, None) == pytest.approx(0.1)
    assert lr_at(9, cfg, None) == pytest.approx(1.0)
    assert lr_at(60, cfg, None) == pytest.approx(0.55)
    assert lr_at(110, cfg, None) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="mlm")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(batch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="weights"):
        DataSpec(weights={"wikipedia": 1.0})
    with pytest.raises(ValueError, match="block_size"):
        block_diffusion_mask(8, 0)


def test_cli_help_and_errors(tmp_path, capsys):
    from dspec.train.__main__ import main  # what ``python -m dspec.train`` runs

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for name in ("tiny-ar", "tiny-bd", "bd-adapt", "--minutes", "--resume", "--device", "--init"):
        assert name in text
    assert main(["bd-adapt", "--out", str(tmp_path / "x")]) == 2  # no --init: clear error
    assert "init" in capsys.readouterr().err
    from dspec.train import run_recipe

    with pytest.raises(ValueError, match="unknown recipe"):
        run_recipe("tiny-xl", tmp_path)
    with pytest.raises(ValueError, match="init"):
        run_recipe("bd-adapt", tmp_path)


def test_shifted_block_size_one_is_the_causal_loss():
    """Right-shifted block diffusion at block size 1 predicts token j from the clean token
    j - 1: exactly next-token prediction (why bd-adapt of a Llama starts from its AR loss)."""
    model = small_model("qwen3", 70, seed=4)
    tokens = torch.randint(3, 70, (2, 10))
    with torch.no_grad():
        bd = block_diffusion_loss(model, tokens, 1, 1, shifted=True)
        ar = causal_lm_loss(model, tokens)
    assert float(bd.count) == float(ar.count) == 18
    assert abs(float(bd.nll_sum) - float(ar.nll_sum)) < 1e-3


@pytest.mark.parametrize("source,family", [("llama", "fast_dllm_v2"), ("qwen3", "sdar")])
def test_bd_adapt(tmp_path, source, family):
    """bd-adapt of a causal checkpoint: Llama -> Fast-dLLM v2 (right-shifted, zero q/k/v
    biases: it starts from the source's exact next-token logits), Qwen3 -> SDAR
    (position-aligned); trains, exports and decodes."""
    sys_path = __import__("sys").path
    sys_path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from dspec.train import run_recipe
    from tiny_checkpoints import write_checkpoint

    src = write_checkpoint(tmp_path / "src", source, seed=3)
    source = dspec.load(src)
    summary = run_recipe(
        "bd-adapt",
        tmp_path / "run",
        init=src,
        mask_token="<unk>",
        max_steps=2,
        num_rows=16,
        progress=False,
        plot=False,
        data_overrides={"weights": {"arithmetic": 1.0}, "seq_len": 16, "arithmetic_problems": 200, "heldout_rows": 2},
        train_overrides={"batch_size": 4, "eval_every": 0, "warmup_steps": 1},
    )
    assert summary["family"] == family and summary["steps"] == 2
    adapted = dspec.load(tmp_path / "run" / "model")
    assert adapted.family == family and adapted.shifted == (family == "fast_dllm_v2")
    assert adapted.block_size == 4
    assert adapted.mask_token_id == source.tokenizer.token_to_id("<unk>")
    out = dspec.generate(adapted, [5, 6, 7], method="diffusion", max_new_tokens=4)
    assert len(out.tokens) == 4
    # step 0 of the adaptation (zero q/k/v biases) is the source model itself
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert any(k.endswith("q_proj.bias") for k in state["model"]) == (family == "fast_dllm_v2")

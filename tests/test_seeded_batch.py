"""Seeded sampling: every request draws from its own random stream, so a seeded batch
decodes exactly as its requests one by one -- request i as the single call seeded
``request_seed(seed, i)`` (request 0: ``seed`` itself) -- whatever the other requests are,
how wide their steps are and when they finish; the same seed reproduces, another differs."""

import pytest
import torch

import dspec
from dspec.decode.generate import method_module
from dspec.decode.sampling import RequestStreams, request_seed

SEED = 7
TEXTS = ["The cat sat on", "Once upon a time there", "def add(a, b):\n    return"]

# the options that make each method's per-cycle plan a per-request one (the documented
# limits: dflash / d2sd verify one length or tree size per batch with a row_cost, d2sd's
# gate makes a cycle without any re-draft DFlash's own, s2d2's redraft="auto" depends on the
# batch size)
CASES = {
    "ar": ("tiny-ar", {}),
    "diffusion": ("tiny-bd", {}),
    "diffusion-threshold": ("tiny-bd", {"threshold": 0.3}),
    "ssd": ("tiny-bd", {}),
    "spiffy": ("tiny-bd", {}),
    "s2d2": ("tiny-bd", {"redraft": True}),
    "s2d2-plain": ("tiny-bd", {"redraft": False, "policy": "min_span"}),
    "diffuspec": ("tiny-ar", {}),
    "dflash": ("tiny-ar", {"row_cost": None}),
    "dflash-tree": ("tiny-ar", {"row_cost": None, "tree": 4}),
    "d2sd": ("tiny-ar", {"row_cost": None, "redraft_min": 0}),
}
_MODELS = {}


def model_of(name):
    if name not in _MODELS:
        _MODELS[name] = dspec.load(name)
    return _MODELS[name]


def run(case, prompts, seed, n=12):
    name, options = CASES[case]
    method = case.split("-")[0]
    out = dspec.generate(
        model_of(name), prompts, method=method, max_new_tokens=n, temperature=1.0, seed=seed, **options
    )
    return [g.tokens for g in out] if isinstance(out, list) else out.tokens


def prompts_of(case):
    tok = model_of(CASES[case][0]).tokenizer
    return [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_batch_equals_its_seeded_singles(case):
    prompts = prompts_of(case)
    batch = run(case, prompts, SEED)
    singles = [run(case, p, request_seed(SEED, i)) for i, p in enumerate(prompts)]
    assert batch == singles
    # request 0 is the single call with the batch's own seed; a batch of two agrees too
    assert run(case, prompts[0], SEED) == batch[0]
    assert run(case, [prompts[2], prompts[1]], SEED)[1] == run(case, prompts[1], request_seed(SEED, 1))


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_batch_reproduces_and_another_seed_differs(case):
    prompts = prompts_of(case)
    state = torch.get_rng_state()
    first = run(case, prompts, SEED)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG untouched
    assert run(case, prompts, SEED) == first
    assert run(case, prompts, SEED + 1) != first


@pytest.mark.parametrize("method", ["ar", "dflash", "ssd"])
def test_rows_that_finish_early_leave_the_others_draws_unchanged(method):
    """An EOS taken from the batch's own output ends some requests early (ar drops their
    rows, the speculative engines shrink the batch): the others still decode as alone."""
    name = "tiny-bd" if method == "ssd" else "tiny-ar"
    model = model_of(name)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    module = method_module(method)
    options = {"row_cost": None, "drafter": None} if method == "dflash" else {}

    def decode(ps, seeds, eos_ids=()):
        with torch.no_grad():
            return module.decode(
                model,
                ps,
                max_new_tokens=14,
                temperature=1.0,
                generator=RequestStreams(seeds),
                eos_ids=eos_ids,
                progress=None,
                **options,
            )[0]

    seeds = [request_seed(SEED, i) for i in range(3)]
    free = decode(prompts, seeds)
    eos = (free[1][3],)  # request 1 ends at its 4th token
    batch = decode(prompts, seeds, eos)
    assert len(batch[1]) <= 4 < max(len(b) for b in batch)
    assert batch == [decode([p], [s], eos)[0] for p, s in zip(prompts, seeds)]


def test_request_streams_are_counter_based():
    """A draw depends on (request seed, the request's draw count) only: a wider draw holds the
    narrower one as its prefix, a row that does not advance keeps its count, and request 0's
    first draw is torch.Generator().manual_seed(seed)'s (the sampler's historic stream)."""
    a = RequestStreams([request_seed(5, i) for i in range(3)])
    b = RequestStreams([request_seed(5, i) for i in range(3)])
    wide = a.uniforms([0, 1, 2], 9)
    narrow = b.uniforms([2, 0], 4, advance=[True, True])
    assert torch.equal(wide[[2, 0], :4], narrow)
    idle = b.uniforms([1, 2], 3, advance=torch.tensor([False, True]))
    assert torch.equal(idle[0], torch.zeros(3))
    assert torch.equal(b.uniforms([1], 9)[0], wide[1])  # request 1's first draw, late
    assert torch.equal(idle[1], a.uniforms([2], 3)[0])  # request 2's second draw
    assert request_seed(11, 0) == 11 and request_seed(11, 1) != 11
    first = RequestStreams([11]).uniforms([0], 5)[0]
    assert torch.equal(first, torch.rand(5, generator=torch.Generator().manual_seed(11)))
    assert ((wide >= 0) & (wide < 1)).all()
    # fresh entropy without a seed, never the global RNG
    state = torch.get_rng_state()
    x, y = (RequestStreams.seeded(None, 1).uniforms([0], 4) for _ in range(2))
    assert not torch.equal(x, y) and torch.equal(torch.get_rng_state(), state)

"""Shared cases of the DFlash and D2SD tests: tiny targets (module fixtures), the oracle-ish
drafter, exact marginals and a chi-square check."""

from __future__ import annotations

import pytest
import torch

import dspec
from dspec.models.dflash import BlockDrafter
from tiny_checkpoints import write_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(path, "qwen3", seed=0)
    return dspec.load(path)


def ar_tokens(model, prompts, n):
    return [dspec.generate(model, p, method="ar", max_new_tokens=n).tokens for p in prompts]


class OracleDrafter(BlockDrafter):
    """Proposes the reference continuation (``refs``: prompt + ar output per request) with
    confidence ``e^strong`` vs 1 for every other token; at absolute positions divisible by
    ``wrong_every`` it proposes ref + 1 with a weaker logit (so D2SD's boundaries find
    it).  A row is matched to the reference whose token at the anchor position equals the
    anchor (the first one on ties; an unmatched row gets reference 0: a bad proposal only
    lowers acceptance, never correctness).  ``runner_up``: the logit of the reference token
    at those positions (default 0, like every other token): between 0 and ``weak`` it is
    the slot's second candidate, which a draft tree verifies too."""

    def __init__(
        self, target, refs, *, kind="dflash", block_size=4, wrong_every=0, strong=6.0, weak=2.0, runner_up=0.0
    ):
        base = BlockDrafter.for_target(target, kind=kind, block_size=block_size)
        super().__init__(base.config, target)
        self.load_state_dict(base.state_dict())
        width = max(len(r) for r in refs) + 64
        table = torch.zeros(len(refs), width, dtype=torch.int64)
        for i, r in enumerate(refs):
            table[i, : len(r)] = torch.tensor(r)
        self.refs = table
        self.wrong_every, self.strong, self.weak, self.runner_up = wrong_every, strong, weak, runner_up
        self.calls = 0

    def forward(self, tokens, positions, cache, *, mask=None, backend=None, logits_from=0, draft_vocab=False):
        self.calls += 1
        vocab = self.config.vocab_size
        b, n = tokens.shape
        pos = positions.clamp_max(self.refs.shape[1] - 1)
        anchor_pos = pos[:, :1]  # every block starts at the anchor
        match = self.refs[:, anchor_pos[:, 0]].T == tokens[:, :1]  # [B, R]
        row = torch.where(match.any(1), match.int().argmax(1), 0)
        want = self.refs[row[:, None], pos]  # [B, N]
        wrong = torch.zeros_like(want, dtype=torch.bool)
        if self.wrong_every:
            wrong = (positions % self.wrong_every == 0) & (positions > anchor_pos)
        true = want
        want = torch.where(wrong, (want + 1) % vocab, want)
        logits = torch.zeros(b, n, vocab)
        logits.scatter_(2, true[..., None], torch.where(wrong, self.runner_up, 0.0)[..., None])
        value = torch.where(wrong, torch.tensor(self.weak), torch.tensor(self.strong))
        logits.scatter_(2, want[..., None], value[..., None])
        return restrict(self, logits, logits_from, draft_vocab)


def restrict(drafter, logits, logits_from, draft_vocab):
    """What BlockDrafter.forward returns for full logits [B, N, V]: slots from
    ``logits_from``, columns of the draft vocabulary when asked and present."""
    logits = logits[:, logits_from:]
    if draft_vocab and drafter.draft_vocab is not None:
        logits = logits[..., drafter.draft_vocab]
    return logits


def oracle_pair(model, prompts, n, **kw):
    ref = ar_tokens(model, prompts, n + 8)
    refs = [p + r for p, r in zip(prompts, ref)]
    return OracleDrafter(model, refs, **kw)


def second_token_marginal(model, prompt, temperature):
    """Exact P(second generated token) under the target at ``temperature``."""
    with torch.no_grad():
        out = model(model.plan([prompt]), logits="last")
        p1 = torch.softmax(out.logits[0, -1].double() / temperature, -1)
        seqs = [prompt + [t] for t in range(model.config.vocab_size)]
        out2 = model(model.plan(seqs), logits="last")
        p2 = torch.softmax(out2.logits[:, -1].double() / temperature, -1)
    return p1 @ p2


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A target with sharper next-token distributions (a larger output head), so a few
    thousand samples resolve its marginals."""
    path = tmp_path_factory.mktemp("peaked")
    write_checkpoint(path, "llama", seed=3)
    model = dspec.load(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model


def shipped_tiny_ar():
    from dspec.models.dflash import shipped_drafter_path

    if not (shipped_drafter_path("tiny-ar", "dflash").is_dir() and shipped_drafter_path("tiny-ar", "vp").is_dir()):
        pytest.skip("the tiny-ar drafters are not shipped in this checkout")
    try:
        return dspec.load("tiny-ar")
    except ValueError:
        pytest.skip("tiny-ar is not shipped in this checkout")


SHIPPED_PROMPTS = ["Compute: 12 + 35 =", "def fibonacci(n):\n    ", "import os\nimport sys\n\n"]

"""Shared cases of the S2D2 tests: the redraft-block checks, used by the mask-adapter tests too."""

from __future__ import annotations

import torch

import dspec
from dspec.models import AttentionPlan
from dspec.ops import pack_mask


def redraft_checks(model, prompts, monkeypatch, **kw) -> dict:
    """Decode each prompt alone (greedy, policy always, redraft blocks) and check every draft
    a verification forward computed against a plain drafting forward of the state it stands
    for: a reused redraft block -- the block as it now stands, the drawn slot [MASK] again --,
    the next block's first state after the finished block and (right-shifted, clean rows
    causal) the boundary state -- the finished block's last slot [MASK] again, the next block
    all [MASK], bidirectional together.  Returns how many of each were checked."""
    from dspec.decode import s2d2

    done = {"reuse": 0, "stale": 0, "next": 0, "boundary": 0}
    verify, draft = s2d2.S2D2Run.verify, s2d2.S2D2Run.draft

    def spy_verify(self, logits, nxt):
        span = self.span_start.clone()
        out = verify(self, logits, nxt)
        self._outcome = (span, out[0].clone(), out[2].clone(), out[3].clone())
        self._draft_calls = 0
        return out

    def boundary_expected(self):
        bs = self.bs
        tokens = torch.cat([self.prev_tokens[:, : bs - 1], torch.full((1, bs + 1), model.mask_token_id)], 1)
        pos = self.block_start[:, None] - bs + torch.arange(2 * bs)[None]
        i = torch.arange(2 * bs)
        dense = (i[None, :] <= i[:, None]) | ((i[:, None] >= bs - 1) & (i[None, :] >= bs - 1))
        out = model(AttentionPlan(tokens, pos, pack_mask(dense[None]), self.cache), return_kv=False)
        return out.logits.float()[:, bs - 1 : 2 * bs - 1]

    def expected(self, tokens):
        if not bool(self.pending[0]):
            pos = self.block_start[:, None] + self.slots
            out = model(AttentionPlan(tokens, pos, self.block_mask_words, self.cache), return_kv=False)
            return self.shift(out.logits.float())
        # a verifying row behind its pending block (not in the cache yet): both blocks, as a
        # drafting forward with a pending block lays them out
        bs = self.bs
        pos = self.block_start[:, None] - bs + torch.arange(2 * bs)[None]
        i = torch.arange(2 * bs)
        pair = i[None, :] // bs <= i[:, None] // bs
        out = model(
            AttentionPlan(torch.cat([self.prev_tokens, tokens], 1), pos, pack_mask(pair[None]), self.cache),
            return_kv=False,
        )
        logits = out.logits.float()
        return logits[:, bs - 1 : 2 * bs - 1] if self.shifted else logits[:, bs:]

    def spy_draft(self, block_logits, drafting, nxt, stale=None):
        masked = self.masked[0]
        call = -1
        if self.has["verify"]:
            call, self._draft_calls = self._draft_calls, self._draft_calls + 1
        if call == 1 and bool(stale[0]):  # the boundary state's drafts
            torch.testing.assert_close(
                block_logits[0, masked], boundary_expected(self)[0, masked], atol=2e-4, rtol=2e-4
            )
            done["boundary"] += 1
        elif call == 0 and bool(self._outcome[1][0]):
            span, _, acc, was_stale = self._outcome
            tokens = self.tokens.clone()
            if bool(was_stale[0]):
                tokens[0, span[0] + acc[0]] = model.mask_token_id
                done["stale"] += 1
            torch.testing.assert_close(block_logits[0, masked], expected(self, tokens)[0, masked], atol=2e-4, rtol=2e-4)
            done["reuse"] += 1
        elif call == 1 and bool(drafting[0]):  # the next block
            torch.testing.assert_close(
                block_logits[0, masked], expected(self, self.tokens)[0, masked], atol=2e-4, rtol=2e-4
            )
            done["next"] += 1
        return draft(self, block_logits, drafting, nxt, stale)

    monkeypatch.setattr(s2d2.S2D2Run, "verify", spy_verify)
    monkeypatch.setattr(s2d2.S2D2Run, "draft", spy_draft)
    monkeypatch.setattr(s2d2, "native_extension", lambda *a: None)  # the spies watch the torch step
    for prompt in prompts:
        dspec.generate(model, prompt, method="s2d2", policy="always", **kw)
    return done

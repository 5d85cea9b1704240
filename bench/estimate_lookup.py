"""What a prompt-lookup branch could add to DFlash, estimated from DFlash's own cycles.

    python bench/estimate_lookup.py [--prompts 8] [--max-ngram 3] [--min-ngram 1] [--drafts 7]

Decodes the e2e grid's first prompts of each set with ``dflash(lookup=None)`` (greedy,
batch 1), records every cycle's accepted drafts, and asks at each cycle what
:func:`dspec.decode.lookup.suffix_match_drafts` would have proposed from the text so far and
how much of it the final output (= ``ar``'s) confirms.  Prints, per set, tokens per cycle of
DFlash and of "the better of the two branches" on the same cycles (an estimate: with longer
acceptances the cycle boundaries would move), and how often the lookup branch is longer /
proposed at all.  Results: bench/results/cpu/amx/lookup_estimate.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspec
from ab_common import grid_texts
from dspec.decode import dflash
from dspec.decode.lookup import suffix_match_drafts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--min-ngram", type=int, default=1)
    ap.add_argument("--drafts", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = dspec.load("smollm2-135m")
    accepted = []
    finish = dflash.SpeculativeRun.finish_cycle

    def record(self, host):
        accepted.append(int(host[0, 0]))
        return finish(self, host)

    dflash.SpeculativeRun.finish_cycle = record
    for pset, texts in grid_texts(model, args.prompts).items():
        base = best = cycles = longer = proposed = 0
        for text in texts:
            accepted.clear()
            prompt = model.tokenizer.encode(text)
            gen = dspec.generate(model, prompt, method="dflash", max_new_tokens=128, lookup=None).tokens
            done = 1  # the prefill's token
            for a in accepted:
                seq = np.array([prompt + gen[:done]])
                drafts, count = suffix_match_drafts(
                    seq,
                    np.array([seq.shape[1]]),
                    max_ngram=args.max_ngram,
                    min_ngram=args.min_ngram,
                    num_drafts=args.drafts,
                )
                prop, truth = drafts[0, : count[0]].tolist(), gen[done : done + args.drafts]
                m = 0
                while m < min(len(prop), len(truth)) and prop[m] == truth[m]:
                    m += 1
                base += 1 + a
                best += 1 + max(a, m)
                longer += m > a
                proposed += bool(prop)
                cycles += 1
                done += a + 1
        print(
            f"{pset}: {cycles} cycles; dflash {base / cycles:.3f} tokens/cycle, with the lookup branch "
            f"{best / cycles:.3f} ({best / base:.3f}x); lookup longer in {longer / cycles:.1%} of cycles, "
            f"proposed in {proposed / cycles:.1%}",
            flush=True,
        )
    dflash.SpeculativeRun.finish_cycle = finish


if __name__ == "__main__":
    main()

"""DiffuSpec's causal-consistency path search (CPS), in plain Python: the oracle of
``csrc/diffuspec_search_cpu.cpp``, which must give exactly the same output.

The lattice of one request is ``L`` slots with up to ``M`` candidate tokens each (from
``mass_candidates`` plus EOS, see ``dspec.decode.path_search.build_lattice``); a candidate
is used when its token is >= 0 and its dLLM log-probability is > -inf.  The lattice is cut
at its first slot without a usable candidate.  A path stops after its first EOS token.

A partial path's score is the float64 sum over its tokens of
``lam * dllm_logprob + (1 - lam) * ngram.logprob(u, v, token)``, where ``(u, v)`` are the two
tokens before it (the committed ``history`` then the path itself; -1 = unknown).  With
``ngram`` None the proxy term is 0 (``lam`` must then be 1).

Beam search (``uniforms`` None): at each slot every unfinished beam is extended by every
usable candidate, a finished beam (ended by EOS) is carried over with its score unchanged,
and the ``beam`` best are kept, ordered by (score descending, parent beam index, candidate
index; a carried beam sorts as candidate -1).  The result is the best beam at the end.
Comparing a finished path with longer ones by the plain sum is what the probabilities
mean: "the text ends here" and "the text goes on with these tokens" are disjoint events.

Sampling (``uniforms`` [B, L] given): one path drawn left to right from
``q_i(c) ∝ exp(lam * dllm_logprob(c) + (1 - lam) * ngram.logprob(u, v, c))`` over the slot's
usable candidates (float64: ``w_c = exp(s_c - max s)``, ``total = sum w`` in candidate order;
the draw is the first candidate whose running sum exceeds ``uniforms[b, i] * total``, the
last usable one when rounding leaves none).  ``q`` returns ``w / total`` (float32) per
candidate: the proposal distribution of each drafted token given the ones before it, which
is what speculative sampling needs.  With ``lam = 1`` it is the drafter's distribution
renormalised over the kept candidates.

Returns ``(tokens int64 [B, L] (-1 past the path), length int64 [B], score float64 [B],
q float32 [B, L, M])``; in beam mode ``q`` is 1 on the chosen candidate (a deterministic
proposal).
"""

from __future__ import annotations

import math

import numpy as np


def path_search(
    cand_tokens, cand_logprobs, lengths, history, eos_ids, ngram, *, beam: int = 3, lam: float = 0.5, uniforms=None
):
    """See the module docstring.  Array inputs are numpy (or anything ``np.asarray`` takes):
    cand_tokens int64 [B, L, M], cand_logprobs float32 [B, L, M], lengths int64 [B] (slots
    used per request, <= L), history int64 [B, 2] (the two committed tokens before the
    path, oldest first), eos_ids ints, uniforms float32 [B, L] or None."""
    tok = np.asarray(cand_tokens, np.int64)
    lp = np.asarray(cand_logprobs, np.float32)
    lengths = np.asarray(lengths, np.int64)
    history = np.asarray(history, np.int64)
    eos = {int(e) for e in eos_ids}
    B, L, M = tok.shape
    out_tok = np.full((B, L), -1, np.int64)
    out_len = np.zeros(B, np.int64)
    out_score = np.zeros(B, np.float64)
    out_q = np.zeros((B, L, M), np.float32)
    lam = float(lam)
    rest = 1.0 - lam

    def proxy(u, v, w):
        return 0.0 if ngram is None else ngram.logprob(u, v, w)

    for b in range(B):
        usable = [
            [m for m in range(M) if tok[b, i, m] >= 0 and float(lp[b, i, m]) != -math.inf]
            for i in range(int(lengths[b]))
        ]
        n = 0
        while n < len(usable) and usable[n]:
            n += 1
        h0, h1 = int(history[b, 0]), int(history[b, 1])
        if uniforms is not None:
            u_arr = np.asarray(uniforms, np.float32)
            path, score = [], 0.0
            for i in range(n):
                u = path[i - 2] if i >= 2 else (h0 if i == 0 else h1)
                v = path[i - 1] if i >= 1 else h1
                cands = usable[i]
                s = [lam * float(lp[b, i, m]) + rest * proxy(u, v, int(tok[b, i, m])) for m in cands]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                total = 0.0
                for x in w:
                    total += x
                target = float(u_arr[b, i]) * total
                pick = len(cands) - 1
                run = 0.0
                for j, x in enumerate(w):
                    run += x
                    if run > target:
                        pick = j
                        break
                for j, m in enumerate(cands):
                    out_q[b, i, m] = np.float32(w[j] / total)
                t = int(tok[b, i, cands[pick]])
                path.append(t)
                score += s[pick]
                if t in eos:
                    break
            out_tok[b, : len(path)] = path
            out_len[b] = len(path)
            out_score[b] = score
            continue
        # beam search: each beam = (score, tokens, finished)
        beams = [(0.0, [], False)]
        for i in range(n):
            cands = []
            for bi, (score, path, done) in enumerate(beams):
                if done:
                    cands.append((score, bi, -1))
                    continue
                u = path[i - 2] if i >= 2 else (h0 if i == 0 else h1)
                v = path[i - 1] if i >= 1 else h1
                for m in usable[i]:
                    t = int(tok[b, i, m])
                    cands.append((score + (lam * float(lp[b, i, m]) + rest * proxy(u, v, t)), bi, m))
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            new = []
            for score, bi, m in cands[:beam]:
                _, path, done = beams[bi]
                if m < 0:
                    new.append((score, path, True))
                else:
                    t = int(tok[b, i, m])
                    new.append((score, path + [t], t in eos))
            beams = new
            if all(d for _, _, d in beams):
                break
        score, path, _ = beams[0]
        out_tok[b, : len(path)] = path
        out_len[b] = len(path)
        out_score[b] = score
        # q: one-hot on the chosen candidate of each slot (the first candidate holding the token)
        for i, t in enumerate(path):
            m = next(m for m in usable[i] if int(tok[b, i, m]) == t)
            out_q[b, i, m] = 1.0
    return out_tok, out_len, out_score, out_q

"""DiffuSpec: a block-diffusion LM drafts for an autoregressive target (lossless).

One cycle per request (the batch runs cycles in lockstep, every request with its own state):

1. **Draft** (one drafter forward).  The drafter keeps its own exact KV cache of the
   committed text up to the last block boundary it has seen complete (blocks are aligned on
   absolute positions, ``position // block_size``, as the drafter's own block-causal
   attention).  The forward's suffix is the committed tokens after that boundary (the
   *pending* tokens) followed by ``k`` [MASK] slots at the next positions, under the
   drafter's block-causal plan (``drafter.plan``): a [MASK] slot sees its own block
   bidirectionally and every earlier block, so a slot in a later block also sees earlier
   slots' [MASK]s, as in the drafter's own multi-block forward.  Slot j predicts the token
   at committed length + j from its own logits; a right-shifted drafter (``drafter.shifted``,
   Dream / Fast-dLLM v2) from the logits one position earlier (slot 0 from the last pending
   token, which is why such a drafter always keeps one pending token).  Complete blocks of
   pending tokens are committed to the drafter's cache from this same forward (their rows see
   no [MASK]: block-causal), so the drafter never runs a separate prefill or re-forward.
2. **Search** (CPU, C++).  CPS (``cps=True``): the drafter's slot distributions are pruned by
   ``mass_candidates`` (mass ``tau``, at most ``max_candidates``), EOS is always kept, and
   ``dspec.decode.path_search`` picks the path maximising ``lam * dLLM log-prob + (1 - lam) *
   3-gram log-prob`` by beam search (width ``beam``), stopping a path after its first EOS.
   Without CPS the draft is the drafter's argmax per slot (sampling: a draw per slot), cut
   after the first EOS.
3. **Verify** (one target forward).  The target's cache holds the committed text but its
   last token; the suffix is that token plus the draft (causal), and ``verify_chain`` accepts
   a prefix and draws the next token.  Accepted drafts and the last token are committed to
   the target cache (``append(counts=1 + accepted)``); the accepted drafts and the new token
   become pending tokens of the drafter.

Lossless sampling (temperature T > 0).  ``verify_chain`` preserves the target distribution
when each draft token x_i is *drawn* from the proposal q_i it is given, q_i being allowed to
depend on x_<i and on anything independent of the verification coins.  DiffuSpec therefore
samples its drafts: with CPS the path is drawn left to right from
``q_i(c) ∝ exp(lam * log p_dLLM,T(c) + (1 - lam) * log p_3gram(c | x_{i-2}, x_{i-1}))`` over
slot i's kept candidates (EOS included) -- the search's own score turned into a left-to-right
proposal; with ``lam = 1`` it is the drafter's probability renormalised over the kept
candidates -- and ``draft_probs`` holds exactly that q_i (zero outside the candidates).
Without CPS, x_i ~ softmax(drafter logits / T) and q_i is that softmax.  (A beam-searched path
is deterministic: it would be lossless only with one-hot proposals, and accept less, so the
beam is used for greedy decoding and the sampled path for T > 0.)  Greedy: a draft of any
origin is verified by exact argmax matching, so the output equals ``ar``'s.

Adaptive draft length (``adaptive=True``, per request, :class:`AdaptiveDraftLength`): EMAs
(factor ``rho``) of the generated path length and the accepted length; after a cycle whose
draft was fully accepted the next length is ``ceil(EMA_generated) + delta`` (grow), otherwise
``ceil(EMA_accepted) + delta``; clipped to ``[k_min, k_max]``.  The first draft has ``k_max``
slots (``draft_len`` when given).  Without ADL every draft has ``draft_len`` slots (an
explicit ``draft_len`` alone turns ADL off).  Drafts never exceed the request's
remaining budget minus one (the verify adds a token).

Host synchronisation: the search runs on the CPU (the lattice is copied once per cycle) and
the accepted counts are read once per cycle (the KV caches keep their lengths on the host and
the per-request draft lengths shape the next forward); all else stays on the device.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..ops import token_stats, verify_chain
from .ngram import NgramLM, default_ngram
from .path_search import build_lattice, path_search
from .sampling import next_tokens

OPTIONS = ("draft_len", "adaptive", "cps", "beam", "tau", "max_candidates", "lam", "k_min", "k_max",
           "delta", "rho", "ngram")
DRAFTER = "model"    # a block-diffusion model (dspec.load: a shipped name or a checkpoint directory)
# the paper's defaults (DiffuSpec, Li et al. 2025)
DEFAULTS = dict(draft_len=20, adaptive=True, cps=True, beam=3, tau=0.8, max_candidates=15, lam=0.5,
                k_min=20, k_max=30, delta=10, rho=0.5)
# target shipped name -> the drafter dspec ships for it (None: not trained yet, and why)
# target -> its shipped drafter; smollm2-135m-bd is an adapter (trained separately),
# present only once that run has shipped it
SHIPPED_DRAFTERS = {"tiny-ar": "tiny-bd", "smollm2-135m": "smollm2-135m-bd"}
_DRAFTER_CACHE: dict = {}


class AdaptiveDraftLength:
    """DiffuSpec's adaptive draft-length controller, one state per request.

    ``k_next = clip(ceil(ema_gen) + delta if the whole draft was accepted else ceil(ema_acc) +
    delta, k_min, k_max)`` with ``ema <- rho * ema + (1 - rho) * observed`` for the generated
    path length (the draft actually proposed, after the EOS / budget cut) and the accepted
    length.  The first draft length is ``k_init`` clipped to [k_min, k_max] (default
    ``k_max``); the EMAs start at the first observation.

    Parameters
    ----------
    batch_size : int, k_min, k_max : int with 1 <= k_min <= k_max, delta : int >= 0,
    rho : float in [0, 1), k_init : int >= 1 or None.
    """

    def __init__(self, batch_size: int, *, k_min: int, k_max: int, delta: int, rho: float,
                 k_init: int | None = None):
        _int_option("k_min", k_min, 1)
        _int_option("k_max", k_max, 1)
        _int_option("delta", delta, 0)
        if k_min > k_max:
            raise ValueError(f"k_min must be <= k_max, got {k_min} > {k_max}")
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0.0 <= rho < 1.0:
            raise ValueError(f"rho must be a number in [0, 1), got {rho!r}")
        self.k_min, self.k_max, self.delta, self.rho = k_min, k_max, delta, float(rho)
        self.ema_gen = torch.full((batch_size,), float("nan"), dtype=torch.float64)
        self.ema_acc = torch.full((batch_size,), float("nan"), dtype=torch.float64)
        if k_init is not None:
            _int_option("k_init", k_init, 1)
        first = k_max if k_init is None else min(max(k_init, k_min), k_max)
        self.k = torch.full((batch_size,), first, dtype=torch.int64)

    def update(self, generated, accepted) -> torch.Tensor:
        """Record one cycle (int [B] generated and accepted lengths); returns the next k [B]."""
        gen = torch.as_tensor(generated, dtype=torch.float64).cpu()
        acc = torch.as_tensor(accepted, dtype=torch.float64).cpu()
        if gen.shape != self.k.shape or acc.shape != self.k.shape:
            raise ValueError(f"generated and accepted must have shape [{self.k.numel()}]")
        if bool((acc > gen).any()) or bool((acc < 0).any()):
            raise ValueError("accepted lengths must lie in [0, generated]")
        first = torch.isnan(self.ema_gen)
        self.ema_gen = torch.where(first, gen, self.rho * self.ema_gen + (1 - self.rho) * gen)
        self.ema_acc = torch.where(first, acc, self.rho * self.ema_acc + (1 - self.rho) * acc)
        grow = acc >= gen
        base = torch.where(grow, self.ema_gen, self.ema_acc)
        self.k = (torch.ceil(base - 1e-9).to(torch.int64) + self.delta).clamp(self.k_min, self.k_max)
        return self.k.clone()

    def select(self, keep) -> None:
        """Keep only the requests ``keep`` (indices), e.g. the unfinished ones."""
        idx = torch.as_tensor(keep, dtype=torch.int64)
        self.ema_gen, self.ema_acc, self.k = self.ema_gen[idx], self.ema_acc[idx], self.k[idx]


def _int_option(name, value, lo):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def resolve_drafter(model, drafter):
    """The drafter to use: ``drafter`` (a model, or a name / path for ``dspec.load``), or the
    one dspec ships for ``model``; checks it can draft for ``model`` (ValueError otherwise)."""
    from ..hub import ADAPTED, adapter_dir, load
    if drafter is None:
        name = getattr(model, "shipped_name", None)
        if SHIPPED_DRAFTERS.get(name) in ADAPTED:
            try:
                adapter_dir(SHIPPED_DRAFTERS[name])
            except ValueError as e:
                raise ValueError(f"no DiffuSpec drafter ships for {name!r} yet (a block-diffusion adaptation "
                                 f"of it is not trained yet); pass drafter= a block-diffusion model "
                                 f"that shares its tokenizer.  {e}") from None
        if name not in SHIPPED_DRAFTERS:
            raise ValueError("method 'diffuspec' needs drafter= (a block-diffusion model sharing the target's "
                             f"tokenizer); dspec ships drafters for {sorted(k for k, v in SHIPPED_DRAFTERS.items() if v)}")
        drafter = SHIPPED_DRAFTERS[name]
    if isinstance(drafter, (str, Path)):
        key = (str(drafter), str(model.device), model.dtype)
        if key not in _DRAFTER_CACHE:
            _DRAFTER_CACHE[key] = load(drafter, device=model.device, dtype=model.dtype)
        drafter = _DRAFTER_CACHE[key]
    check_pair(model, drafter)
    return drafter


def check_pair(model, drafter) -> None:
    """ValueError unless ``drafter`` is a block-diffusion model that can draft for the causal
    ``model``: same device and dtype, and the same tokens under the same ids (every token of
    the target's tokenizer has the same id in the drafter's; the drafter may add its [MASK])."""
    if not hasattr(drafter, "config") or not hasattr(drafter, "plan"):
        raise ValueError(f"drafter must be a dspec model (dspec.load), got {type(drafter).__name__}")
    if model.attention != "causal":
        raise ValueError(f"method 'diffuspec' verifies with an autoregressive target; {model.family!r} "
                         f"attends {model.attention!r}")
    if drafter.mask_token_id is None or drafter.attention != "block_causal":
        raise ValueError(f"the DiffuSpec drafter must be a block-diffusion model (SDAR, Fast-dLLM v2: "
                         f"block-causal with a [MASK] token); got {drafter.family!r} ({drafter.attention})")
    if drafter.device != model.device or drafter.dtype != model.dtype:
        raise ValueError(f"drafter is {drafter.dtype} on {drafter.device}, the target {model.dtype} on "
                         f"{model.device}: load both on one device in one dtype")
    tt, dt = model.tokenizer, drafter.tokenizer
    if tt is not None and dt is not None:
        tv = tt.inner.get_vocab(with_added_tokens=True)
        dv = dt.inner.get_vocab(with_added_tokens=True)
        bad = [tok for tok, i in tv.items() if dv.get(tok) != i]
        if bad:
            raise ValueError(f"the drafter's tokenizer differs from the target's ({len(bad)} of {len(tv)} "
                             f"target tokens have another id or are missing, e.g. {bad[:3]}); DiffuSpec "
                             f"needs a drafter sharing the target's tokenizer")
    elif drafter.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
                         f"({model.config.vocab_size}) and there is no tokenizer to compare")


@torch.no_grad()
def decode_diffuspec(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                     generator: torch.Generator | None = None, eos_ids=(), progress=None, drafter=None,
                     draft_len: int | None = None, adaptive: bool | None = None, cps: bool | None = None,
                     beam: int | None = None, tau: float | None = None, max_candidates: int | None = None,
                     lam: float | None = None, k_min: int | None = None, k_max: int | None = None,
                     delta: int | None = None, rho: float | None = None, ngram=None):
    """DiffuSpec decoding of a ragged batch; returns (tokens per request, stats).

    Options (defaults: the paper's): ``draft_len`` (k when ``adaptive`` is False, 20; given
    alone it turns ADL off; with ``adaptive=True`` it is the first draft's length),
    ``adaptive`` (ADL, True), ``cps`` (path search, True), ``beam`` (3), ``tau`` (0.8),
    ``max_candidates`` (M_max, 15), ``lam`` (0.5), ``k_min`` / ``k_max`` (20 / 30), ``delta``
    (10), ``rho`` (0.5), ``ngram`` (the causal proxy: an ``NgramLM``, a path to a saved one,
    or None for :func:`dspec.decode.ngram.default_ngram`; unused when ``lam = 1``).

    Stats: ``nfe`` {"target": verify forwards + prefill, "drafter": draft forwards};
    ``mean_accepted``: tokens committed per request per target verification forward
    (accepted drafts + the verify's own token, averaged over every (request, cycle) pair in
    which the request was still decoding; AR = 1); ``mean_draft_len`` (drafted tokens per
    request per cycle), ``mean_accepted_drafts``, ``cycles``, ``time_draft_s`` (drafter
    forwards), ``time_search_s`` (lattice + path search), ``time_verify_s`` (target forwards,
    verification, commits).
    """
    opts = dict(DEFAULTS)
    if adaptive is None and draft_len is not None:
        adaptive = False                      # an explicit draft_len asks for a fixed length
    for k, v in dict(draft_len=draft_len, adaptive=adaptive, cps=cps, beam=beam, tau=tau,
                     max_candidates=max_candidates, lam=lam, k_min=k_min, k_max=k_max, delta=delta,
                     rho=rho).items():
        if v is not None:
            opts[k] = v
    _int_option("draft_len", opts["draft_len"], 1)
    _int_option("beam", opts["beam"], 1)
    _int_option("max_candidates", opts["max_candidates"], 1)
    for flag in ("adaptive", "cps"):
        if not isinstance(opts[flag], bool):
            raise ValueError(f"{flag} must be a bool, got {opts[flag]!r}")
    tau_v, lam_v = opts["tau"], opts["lam"]
    if isinstance(tau_v, bool) or not isinstance(tau_v, (int, float)) or not 0.0 < tau_v <= 1.0:
        raise ValueError(f"tau must be a number in (0, 1], got {tau_v!r}")
    if isinstance(lam_v, bool) or not isinstance(lam_v, (int, float)) or not 0.0 <= lam_v <= 1.0:
        raise ValueError(f"lam must be a number in [0, 1], got {lam_v!r}")
    batch = len(prompts)
    controller = None
    if opts["adaptive"]:
        controller = AdaptiveDraftLength(batch, k_min=opts["k_min"], k_max=opts["k_max"], delta=opts["delta"],
                                         rho=opts["rho"], k_init=draft_len)
    drafter = resolve_drafter(model, drafter)
    lm = None
    if opts["cps"] and lam_v < 1.0:
        if ngram is None:
            lm = default_ngram(model)
        elif isinstance(ngram, (str, Path)):
            lm = NgramLM.load(ngram)
        elif isinstance(ngram, NgramLM):
            lm = ngram
        else:
            raise ValueError(f"ngram must be an NgramLM, a path to a saved one, or None; got {type(ngram).__name__}")
        if lm.vocab_size < model.config.vocab_size:
            raise ValueError(f"ngram covers {lm.vocab_size} ids, the target's vocabulary {model.config.vocab_size}")

    dev = model.device
    V = model.config.vocab_size
    Vd = drafter.config.vocab_size
    bs = drafter.block_size
    mask_id = drafter.mask_token_id
    eos = sorted({int(e) for e in eos_ids if 0 <= int(e) < V})
    eos_set = set(eos)
    sampling = temperature > 0

    # ---- state: per active request
    active = list(range(batch))
    generated = [[] for _ in range(batch)]
    history = [list(p) for p in prompts]                 # committed text (prompt + generated)
    last = [p[-1] for p in prompts]                      # the committed token not in the target cache
    d_start = [0] * batch                                # drafter cache length (a block boundary)
    fixed_k = opts["draft_len"]
    t_fwd = d_fwd = 0
    time_draft = time_search = time_verify = 0.0
    rows = committed_total = drafted_total = accepted_total = 0
    cycles = 0

    tcache = model.new_cache(batch)
    heads = [p[:-1] for p in prompts]
    if any(heads):
        # a one-token prompt commits nothing (a stand-in token, count 0)
        out = model(model.plan([h or p[:1] for h, p in zip(heads, prompts)], tcache), logits=None)
        tcache.append(out.suffix_kv, counts=[len(h) for h in heads])
        t_fwd += 1
    dcache = drafter.new_cache(batch)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    while active:
        cycles += 1
        n_act = len(active)
        remaining = [max_new_tokens - len(generated[r]) for r in active]
        k_req = controller.k.tolist() if controller is not None else [fixed_k] * n_act
        k = [max(0, min(kk, rem - 1)) for kk, rem in zip(k_req, remaining)]
        kmax = max(k)
        draft = torch.zeros(n_act, max(kmax, 1), dtype=torch.int64)
        n_draft = torch.zeros(n_act, dtype=torch.int64)
        draft_probs = None

        # ---- 1. draft: pending tokens + k [MASK]s in one drafter forward
        if kmax > 0:
            t0 = time.perf_counter()
            pending = [history[r][d_start[i]:] for i, r in enumerate(active)]
            seqs = [pnd + [mask_id] * kk or [mask_id] for pnd, kk in zip(pending, k)]
            shift = 1 if drafter.shifted else 0
            plen = torch.tensor([len(p) for p in pending])
            slen = torch.tensor([len(s) for s in seqs])
            # logits row of draft slot j: the slot itself (or the one before, shifted); rows past
            # a request's k only pad the batch (clamped into its sequence, ignored)
            idx = torch.minimum(plen[:, None] - shift + torch.arange(kmax), slen[:, None] - 1).to(dev)
            out = drafter(drafter.plan(seqs, dcache), logits=idx)
            d_fwd += 1
            commit = [((d_start[i] + len(p)) // bs) * bs - d_start[i] for i, p in enumerate(pending)]
            dcache.append(out.suffix_kv, counts=commit)
            for i, c in enumerate(commit):
                d_start[i] += c
            logits = out.logits.float()
            if Vd >= V:
                logits = logits[..., :V]
            else:
                logits = torch.cat([logits, logits.new_full((*logits.shape[:2], V - Vd), -math.inf)], -1)
            if mask_id < V:
                logits[..., mask_id] = -math.inf      # [MASK] is never a draft
            sync()
            time_draft += time.perf_counter() - t0

            # ---- 2. search (CPS) or per-slot choice
            t0 = time.perf_counter()
            k_t = torch.tensor(k)
            if opts["cps"]:
                cand_tok, cand_lp = build_lattice(logits, tau=tau_v, max_candidates=opts["max_candidates"],
                                                  eos_ids=eos, temperature=temperature if sampling else 1.0)
                hist = torch.tensor([[h[-2] if len(h) >= 2 else -1, h[-1]] for h in
                                     (history[r] for r in active)])
                uniforms = None
                if sampling:
                    uniforms = torch.rand(n_act, kmax, generator=generator, device=dev).cpu()
                res = path_search(cand_tok, cand_lp, k_t, hist, eos, lm, beam=opts["beam"], lam=lam_v,
                                  uniforms=uniforms)
                draft[:, :kmax] = res.tokens.clamp(min=0)
                n_draft = res.length.clone()
                if sampling:
                    q = res.q.to(dev)
                    ct = cand_tok.to(dev)
                    draft_probs = torch.zeros(n_act, kmax, V, device=dev)
                    draft_probs.scatter_add_(-1, ct.clamp(min=0), torch.where(ct >= 0, q, torch.zeros_like(q)))
            else:
                flat = logits.reshape(n_act * kmax, V)
                if sampling:
                    choice = next_tokens(flat, temperature, generator).view(n_act, kmax)
                    draft_probs = torch.softmax(logits / temperature, dim=-1)
                else:
                    choice = token_stats(flat).token.view(n_act, kmax)
                choice = choice.cpu()
                draft[:, :kmax] = choice
                # cut after the first EOS and at k
                slot = torch.arange(kmax)
                is_eos = torch.isin(choice, torch.tensor(eos or [-1])) & (slot[None] < k_t[:, None])
                first = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1) + 1, k_t)
                n_draft = torch.minimum(first, k_t)
            sync()
            time_search += time.perf_counter() - t0

        # ---- 3. verify: [last] + draft through the target, one forward
        t0 = time.perf_counter()
        n_list = n_draft.tolist()
        seqs = [[last[r]] + draft[i, :n].tolist() for i, (r, n) in enumerate(zip(active, n_list))]
        lmax = max(n_list)
        out = model(model.plan(seqs, tcache), logits="all")
        t_fwd += 1
        tl = out.logits[:, :lmax + 1]
        if tl.shape[1] < lmax + 1:                   # cannot happen: the longest row has lmax + 1 tokens
            raise RuntimeError("verify logits shorter than the draft")
        dp = draft_probs[:, :lmax] if draft_probs is not None else None
        ver = verify_chain(draft[:, :lmax].to(dev), tl, draft_probs=dp, num_drafts=n_draft.to(dev),
                           temperature=temperature, generator=generator)
        acc = ver.num_accepted.cpu()
        new_tok = ver.tokens.cpu()
        tcache.append(out.suffix_kv, counts=(acc + 1).tolist())
        sync()
        time_verify += time.perf_counter() - t0

        # ---- bookkeeping per request
        finished = []
        acc_l = acc.tolist()
        for i, r in enumerate(active):
            a = acc_l[i]
            toks = new_tok[i, :a + 1].tolist()
            history[r].extend(toks)
            last[r] = toks[-1]
            rows += 1
            committed_total += a + 1
            drafted_total += n_list[i]
            accepted_total += a
            done = False
            before = len(generated[r])
            for t in toks:
                if len(generated[r]) >= max_new_tokens:
                    done = True
                    break
                generated[r].append(t)
                if t in eos_set:
                    done = True
                    break
            if len(generated[r]) >= max_new_tokens:
                done = True
            if progress is not None:
                progress.update((len(generated[r]) - before) / batch)
            if done:
                finished.append(i)
        if controller is not None:
            controller.update(n_draft, acc)
        if finished:
            keep = [i for i in range(len(active)) if i not in set(finished)]
            if not keep:
                break
            tcache = tcache.select(keep)
            dcache = dcache.select(keep)
            d_start = [d_start[i] for i in keep]
            if controller is not None:
                controller.select(keep)
            active = [active[i] for i in keep]

    stats = {
        "nfe": {"target": t_fwd, "drafter": d_fwd},
        "mean_accepted": committed_total / max(rows, 1),
        "mean_accepted_drafts": accepted_total / max(rows, 1),
        "mean_draft_len": drafted_total / max(rows, 1),
        "acceptance_rate": accepted_total / max(drafted_total, 1),
        "cycles": cycles,
        "time_draft_s": time_draft, "time_search_s": time_search, "time_verify_s": time_verify,
        "cps": opts["cps"], "adaptive": opts["adaptive"],
        "search_backend": _search_backend() if opts["cps"] else None,
    }
    return generated, stats


def _search_backend() -> str:
    from .path_search import cpp_available
    return "cpp" if cpp_available() else "python"


decode = decode_diffuspec

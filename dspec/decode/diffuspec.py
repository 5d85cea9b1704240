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
   no [MASK]: block-causal), so the drafter never runs a separate prefill or re-forward.  A
   drafter that is a mask-selective adaptation of the target (``smollm2-135m-bd`` for
   ``smollm2-135m``: clean tokens computed exactly as the target computes them,
   :func:`shares_target_cache`) keeps no cache: it drafts against the target's, its forward
   the last committed token and the [MASK] slots.
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

import functools
import math
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from ..masks import padded_prefix_tree
from ..models import AttentionPlan
from ..models.dense import dense
from ..models.stack import frozen_weights
from ..ops import token_stats, verify_chain, verify_tree
from .bounds import MAX_BEAM, MAX_DRAFT_LEN, check_max, check_rows
from .cpu_cost import resolve_lookup
from .lookup import MIN_NGRAM, suffix_match_drafts
from .ngram import NgramLM, causal_proxy, load_cached
from .outputs import OutputBuffer
from .path_search import build_lattice, path_search
from .sampling import next_tokens, non_finite_error, request_streams, require_finite

OPTIONS = (
    "draft_len",
    "adaptive",
    "cps",
    "beam",
    "tau",
    "max_candidates",
    "lam",
    "k_min",
    "k_max",
    "delta",
    "rho",
    "ngram",
    "draft_vocab",
    "lookup",
)
DRAFTER = "model"  # a block-diffusion model (dspec.load: a shipped name or a checkpoint directory)
# the paper's defaults (DiffuSpec, Li et al. 2025)
DEFAULTS = dict(
    draft_len=20,
    adaptive=True,
    cps=True,
    beam=3,
    tau=0.8,
    max_candidates=15,
    lam=0.5,
    k_min=20,
    k_max=30,
    delta=10,
    rho=0.5,
)
#: ADL's bounds for a CPU model when none of k_min / k_max / delta is given: a draft of k and its
#: verification of k + 1 rows stay within the 16 rows a CPU forward carries at about one row's
#: cost (``cpu_cost``).  Measured on smollm2-135m (3 prompts per set, arms interleaved in one
#: process): 1.06x ``ar`` against the paper's 20 / 30 / 10 at 0.84x (fixed k 6 / 8 / 11:
#: 1.03 / 1.02 / 0.98x).
CPU_ADL = dict(k_min=4, k_max=12, delta=2)
#: ``preset="paper"``: DiffuSpec as published -- ADL's bounds 20 / 30 / 10 on every device, the
#: drafter's full vocabulary, no prompt-lookup branch
PAPER = dict(k_min=20, k_max=30, delta=10, draft_vocab=None, lookup=None)
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

    def __init__(self, batch_size: int, *, k_min: int, k_max: int, delta: int, rho: float, k_init: int | None = None):
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
                raise ValueError(
                    f"no DiffuSpec drafter ships for {name!r} yet (a block-diffusion adaptation "
                    f"of it is not trained yet); pass drafter= a block-diffusion model "
                    f"that shares its tokenizer.  {e}"
                ) from None
        if name not in SHIPPED_DRAFTERS:
            raise ValueError(
                "method 'diffuspec' needs drafter= (a block-diffusion model sharing the target's "
                "tokenizer); dspec ships drafters for "
                f"{sorted(k for k, v in SHIPPED_DRAFTERS.items() if v)}"
            )
        drafter = SHIPPED_DRAFTERS[name]
    if isinstance(drafter, (str, Path)):
        key = (str(drafter), str(model.device), model.dtype)
        if key not in _DRAFTER_CACHE:
            _DRAFTER_CACHE[key] = load(drafter, device=model.device, dtype=model.dtype)
        drafter = _DRAFTER_CACHE[key]
    check_pair(model, drafter)
    return drafter


# drafter tokenizer -> the target tokenizers whose every token it maps to the same id (checked
# once per pair: comparing two 49k-token vocabularies took ~50 ms of every generate call)
_SAME_VOCAB: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _vocab_mismatches(target_tok, drafter_tok) -> list[str]:
    """The target's tokens that the drafter's tokenizer lacks or maps to another id."""
    seen = _SAME_VOCAB.get(drafter_tok)
    if seen is not None and target_tok in seen:
        return []
    tv = target_tok.inner.get_vocab(with_added_tokens=True)
    dv = drafter_tok.inner.get_vocab(with_added_tokens=True)
    bad = [tok for tok, i in tv.items() if dv.get(tok) != i]
    if not bad:
        _SAME_VOCAB.setdefault(drafter_tok, weakref.WeakSet()).add(target_tok)
    return bad


def check_pair(model, drafter) -> None:
    """ValueError unless ``drafter`` is a block-diffusion model that can draft for the causal
    ``model``: same device and dtype, and the same tokens under the same ids (every token of
    the target's tokenizer has the same id in the drafter's; the drafter may add its [MASK])."""
    if not hasattr(drafter, "config") or not hasattr(drafter, "plan"):
        raise ValueError(f"drafter must be a dspec model (dspec.load), got {type(drafter).__name__}")
    if model.attention != "causal":
        raise ValueError(
            f"method 'diffuspec' verifies with an autoregressive target; {model.family!r} attends {model.attention!r}"
        )
    if drafter.mask_token_id is None or drafter.attention != "block_causal":
        raise ValueError(
            f"the DiffuSpec drafter must be a block-diffusion model (SDAR, Fast-dLLM v2: "
            f"block-causal with a [MASK] token); got {drafter.family!r} ({drafter.attention})"
        )
    if drafter.device != model.device or drafter.dtype != model.dtype:
        raise ValueError(
            f"drafter is {drafter.dtype} on {drafter.device}, the target {model.dtype} on "
            f"{model.device}: load both on one device in one dtype"
        )
    tt, dt = model.tokenizer, drafter.tokenizer
    if tt is not None and dt is not None:
        bad = _vocab_mismatches(tt, dt)
        if bad:
            raise ValueError(
                f"the drafter's tokenizer differs from the target's ({len(bad)} of "
                f"{tt.inner.get_vocab_size(with_added_tokens=True)} "
                f"target tokens have another id or are missing, e.g. {bad[:3]}); DiffuSpec "
                f"needs a drafter sharing the target's tokenizer"
            )
    elif drafter.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
            f"({model.config.vocab_size}) and there is no tokenizer to compare"
        )


def _options(draft_len, adaptive, **given) -> dict:
    """The paper's defaults overridden by the given options, checked."""
    opts = dict(DEFAULTS)
    if adaptive is None and draft_len is not None:
        adaptive = False  # an explicit draft_len asks for a fixed length
    for k, v in dict(draft_len=draft_len, adaptive=adaptive, **given).items():
        if v is not None:
            opts[k] = v
    _int_option("draft_len", opts["draft_len"], 1)
    _int_option("beam", opts["beam"], 1)
    _int_option("max_candidates", opts["max_candidates"], 1)
    check_max("draft_len", opts["draft_len"], MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    check_max("beam", opts["beam"], MAX_BEAM, "MAX_BEAM")
    for name in ("k_min", "k_max"):  # (their types: AdaptiveDraftLength)
        check_max(name, opts[name], MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    for flag in ("adaptive", "cps"):
        if not isinstance(opts[flag], bool):
            raise ValueError(f"{flag} must be a bool, got {opts[flag]!r}")
    tau_v, lam_v = opts["tau"], opts["lam"]
    if isinstance(tau_v, bool) or not isinstance(tau_v, (int, float)) or not 0.0 < tau_v <= 1.0:
        raise ValueError(f"tau must be a number in (0, 1], got {tau_v!r}")
    if isinstance(lam_v, bool) or not isinstance(lam_v, (int, float)) or not 0.0 <= lam_v <= 1.0:
        raise ValueError(f"lam must be a number in [0, 1], got {lam_v!r}")
    return opts


def _causal_proxy(model, opts, ngram):
    """The n-gram LM the path search scores causality with (None when CPS is off or lam = 1)."""
    if not opts["cps"] or opts["lam"] >= 1.0:
        return None
    if ngram is None:
        lm = causal_proxy(model)
    elif isinstance(ngram, (str, Path)):
        lm = load_cached(ngram)
    elif isinstance(ngram, NgramLM):
        lm = ngram
    else:
        raise ValueError(f"ngram must be an NgramLM, a path to a saved one, or None; got {type(ngram).__name__}")
    if lm.vocab_size < model.config.vocab_size:
        raise ValueError(f"ngram covers {lm.vocab_size} ids, the target's vocabulary {model.config.vocab_size}")
    return lm


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def resolve_draft_vocab(model, drafter, draft_vocab, eos_ids) -> torch.Tensor | None:
    """The token ids the drafter drafts over (int64 [V'] on the model's device), or None for
    the whole vocabulary.

    "auto" (the default): on a CPU model, the draft vocabulary shipped beside the drafter
    (``draft_vocab.safetensors`` of a shipped block-diffusion model: the target's most frequent
    response tokens); None elsewhere.  The drafter's output head then reads only those rows
    (FR-Spec's frequency-ranked drafting): on the CPU the head is ~20 % of a SmolLM2-135M
    forward's weight bytes.  The target verifies every token, so greedy outputs are unchanged
    and sampling stays exact (the drafts' proposal is the drafter's distribution renormalised
    over the draft vocabulary).  EOS ids are always added; the drafter's [MASK] never drafts.
    """
    if isinstance(draft_vocab, str):
        if draft_vocab != "auto":
            raise ValueError(f"draft_vocab must be 'auto', None or a 1-D tensor of token ids, got {draft_vocab!r}")
        path = _shipped_draft_vocab(drafter) if model.device.type == "cpu" else None
        if path is None:
            return None
        draft_vocab = _load_draft_vocab(str(path))
    if draft_vocab is None:
        return None
    ids = torch.as_tensor(draft_vocab)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids, got {ids.dtype} {list(ids.shape)}")
    ids = ids.to(torch.int64).cpu()
    v = min(model.config.vocab_size, drafter.config.vocab_size)
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise ValueError(f"draft_vocab ids must lie in [0, {v}), got [{int(ids.min())}, {int(ids.max())}]")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("draft_vocab ids must be distinct")
    eos = torch.tensor(sorted({int(e) for e in eos_ids if 0 <= int(e) < v}), dtype=torch.int64)
    ids = torch.cat([ids, eos[~torch.isin(eos, ids)]])
    ids = ids[ids != drafter.mask_token_id]
    return ids.to(model.device)


_SHARES_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SAME_ARCH = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "rope_scaling",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "embed_scale",
)


def shares_target_cache(model, drafter) -> bool:
    """Whether ``drafter`` computes every clean (non-[MASK]) token exactly as the causal
    ``model`` does -- a mask-selective adaptation of it (``dspec.models.mask_adapter``: clean
    tokens attend causally and pass no adapter, e.g. ``smollm2-135m-bd`` for ``smollm2-135m``)
    with the target's architecture and weights.  Its keys and values of the committed text are
    then the target's (the same computation; only rows batched into other forwards may round
    differently), so it drafts against the target's KV cache: its forward is the last
    committed token and the [MASK] slots, with no cache of its own to keep -- fewer rows and
    no second commit a cycle (checked once per pair: the weights compared tensor by tensor)."""
    if (
        not drafter.config.clean_causal
        or getattr(drafter, "mask_adapter", None) is None
        or drafter.device != model.device
        or drafter.dtype != model.dtype
    ):
        return False
    if any(getattr(model.config, k) != getattr(drafter.config, k) for k in _SAME_ARCH):
        return False
    known = _SHARES_CACHE.setdefault(drafter, weakref.WeakKeyDictionary())
    if model not in known:
        ours = model.state_dict()
        theirs = drafter.state_dict()
        known[model] = all(
            k in theirs and theirs[k].shape == v.shape and theirs[k].dtype == v.dtype and torch.equal(theirs[k], v)
            for k, v in ours.items()
        )
    return known[model]


@functools.lru_cache(maxsize=8)
def _load_draft_vocab(path: str) -> torch.Tensor:
    from safetensors.torch import load_file

    ids = load_file(path).get("ids")
    if ids is None:
        raise ValueError(f"{path} holds no 'ids' tensor")
    return ids


_DRAFT_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _draft_head(drafter, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's output-head rows ``ids`` (gathered once per drafter and vocabulary, again
    when the head changes)."""
    w = drafter.output_weight
    key = (w.data_ptr(), w._version, w.dtype, hash(ids.cpu().numpy().tobytes()))
    cached = _DRAFT_HEADS.get(drafter)
    if cached is None or cached[0] != key:
        cached = (key, w.detach().index_select(0, ids.to(w.device)).contiguous())
        _DRAFT_HEADS[drafter] = cached
    return cached[1]


def _shipped_draft_vocab(drafter):
    from ..hub import assets_dir

    name = getattr(drafter, "shipped_name", None)
    path = assets_dir() / name / DRAFT_VOCAB_FILE if name else None
    return path if path is not None and path.is_file() else None


class DiffuSpecRun:
    """The live requests' state (committed text, target and drafter caches) and one
    DiffuSpec cycle per :meth:`cycle`: draft, search, verify, commit -- each with array ops
    over the batch (no Python loop over requests or tokens).

    ``rows`` maps the live batch rows to request indices.  A request's committed text is its
    prompt (right-aligned in ``prompt_buf`` [B, P]) followed by its generated tokens
    (``outputs.tokens``): text position t of request b is column ``P - prompt_len[b] + t`` of
    their concatenation.
    """

    def __init__(
        self,
        model,
        drafter,
        prompts,
        opts,
        lm,
        controller,
        *,
        max_new_tokens,
        temperature,
        generator,
        eos_ids,
        progress,
        draft_ids=None,
        lookup=None,
    ):
        self.model, self.drafter, self.opts, self.lm, self.controller = model, drafter, opts, lm, controller
        self.draft_ids = draft_ids
        self.draft_head = None
        if draft_ids is not None:  # the head's draft-vocabulary rows
            self.draft_head = _draft_head(drafter, draft_ids)
        self.temperature = temperature
        self.sampling = temperature > 0
        self.dev = model.device
        self.streams = request_streams(generator, len(prompts), self.dev)  # one stream per request
        self.V, self.Vd = model.config.vocab_size, drafter.config.vocab_size
        self.bs, self.mask_id = drafter.block_size, drafter.mask_token_id
        self.eos = sorted({int(e) for e in eos_ids if 0 <= int(e) < self.V})
        if draft_ids is not None:  # the EOS ids' columns among the drafted logits
            eos_t = torch.tensor(self.eos, dtype=torch.int64, device=draft_ids.device)
            self.eos_columns = (draft_ids[:, None] == eos_t[None]).any(1).nonzero()[:, 0].tolist()
        batch = self.batch = len(prompts)
        self.rows = np.arange(batch)  # live batch row -> request index
        self.outputs = OutputBuffer(batch, max_new_tokens, self.eos, progress)
        self.lookup = lookup
        self.prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(self.prompt_len.max())
        self.prompt_buf = np.zeros((batch, width), dtype=np.int64)
        self.prompt_buf[np.arange(width)[None, :] >= width - self.prompt_len[:, None]] = np.concatenate(
            [np.asarray(p, dtype=np.int64) for p in prompts]
        )
        self.d_start = np.zeros(batch, dtype=np.int64)  # drafter cache length (a block boundary)
        self.t_fwd = self.d_fwd = 0
        self.time = {"draft": 0.0, "search": 0.0, "verify": 0.0}
        self.row_cycles = self.committed_total = self.drafted_total = self.accepted_total = 0
        self.lookup_nodes = 0
        self.cycles = 0

        # the prompt in one forward and the first token from its last logits, as ar does: every
        # later target row is then computed inside a verification chain, and the C++
        # attention makes those rows bit-identical to one-token steps, so greedy DiffuSpec
        # reproduces ar in bf16 as in fp32 (a prompt's last token verified with the drafts
        # would be computed in a different forward than ar's prefill computes it)
        self.tcache = model.new_cache(batch)
        plan = model.plan(prompts, self.tcache)
        out = model(plan, logits="last")
        self.tcache.append(out.suffix_kv, counts=plan.lengths)
        self.t_fwd += 1
        # a drafter that computes clean tokens as the target does drafts against the target's
        # cache (its forward: the last committed token and the [MASK] slots)
        self.shared = shares_target_cache(model, drafter)
        self.dcache = None if self.shared else drafter.new_cache(batch)
        first = next_tokens(
            out.logits[:, -1],
            temperature,
            uniforms=self.streams.uniforms(self.rows, 1)[:, 0] if self.sampling else None,
            who="target model",
        )
        first = first.cpu().numpy()
        done = self.outputs.extend(self.rows, first[:, None], np.ones(batch, dtype=np.int64))
        if done.any():
            self.drop(done)

    @property
    def active(self) -> bool:
        return len(self.rows) > 0

    def _text(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The live rows' committed text: (tokens [A, P + max_new], column of text position 0
        [A], text length [A])."""
        req = self.rows
        text = np.concatenate([self.prompt_buf[req], self.outputs.tokens[req]], 1)
        start = self.prompt_buf.shape[1] - self.prompt_len[req]
        return text, start, self.prompt_len[req] + self.outputs.lengths[req]

    def _timed(self, phase: str, t0: float) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        self.time[phase] += time.perf_counter() - t0

    def cycle(self) -> bool:
        """One draft-search-verify cycle for every live request; False when none is left."""
        self.cycles += 1
        n_act = len(self.rows)
        remaining = self.outputs.remaining(self.rows)
        k_req = (
            self.controller.k.numpy()
            if self.controller is not None
            else np.full(n_act, self.opts["draft_len"], dtype=np.int64)
        )
        k = np.clip(k_req, 0, remaining - 1)
        kmax = int(k.max())
        draft = torch.zeros(n_act, max(kmax, 1), dtype=torch.int64)
        n_draft = torch.zeros(n_act, dtype=torch.int64)
        draft_probs = None
        text, start, length = self._text()
        if kmax > 0:
            logits = self.draft(k, text, start, length)
            n_draft, draft_probs = self.search(logits, k, draft, text, start, length)
        if self.lookup:
            acc, new_tok = self.verify_tree(text, start, length, draft, n_draft)
            # ADL sizes the dLLM's draft: its own accepted prefix, not a lookup branch's
            w = min(draft.shape[1], new_tok.shape[1])  # the tree may be narrower than draft
            own = (new_tok[:, :w] == draft[:, :w]) & (torch.arange(w) < n_draft[:, None])
            own = own.to(torch.int64).cumprod(1).sum(1).minimum(acc)
        else:
            acc, new_tok = self.verify(text, start, length, draft, n_draft, draft_probs)
            own = acc
        done = self.commit(acc, new_tok, n_draft)
        if self.controller is not None:
            self.controller.update(n_draft, own)
        if done.any():
            self.drop(done)
        return self.active

    def draft(self, k: np.ndarray, text, start, length) -> torch.Tensor:
        """Pending tokens + k [MASK]s per request in one drafter forward: the draft slots'
        logits [A, kmax, V] over the target's vocabulary ([MASK] never drafted)."""
        t0 = time.perf_counter()
        drafter, kmax, V, Vd = self.drafter, int(k.max()), self.V, self.Vd
        # pending: the committed tokens the drafter's cache lacks (with the target's cache:
        # only the last one)
        first = length - 1 if self.shared else self.d_start
        plen = length - first
        # then the [MASK]s; past slen, padding (Model.plan writes its pad id there); a request
        # with nothing to forward gets one [MASK]
        slen = np.maximum(plen + k, 1)
        col = np.arange(int(slen.max()))
        src = text[np.arange(len(k))[:, None], np.minimum((start + first)[:, None] + col, text.shape[1] - 1)]
        seqs = np.where(col < plen[:, None], src, self.mask_id)
        cache = self.tcache if self.shared else self.dcache
        shift = 1 if drafter.shifted else 0
        # logits row of draft slot j: the slot itself (or the one before, shifted); rows past
        # a request's k only pad the batch (clamped into its sequence, ignored)
        idx = torch.from_numpy(np.minimum(plen[:, None] - shift + np.arange(kmax), slen[:, None] - 1)).to(self.dev)
        plan = drafter.plan(torch.from_numpy(seqs), cache, lengths=torch.from_numpy(slen))
        if self.draft_ids is not None:
            # the final normed rows, and the head over the draft vocabulary only
            out = drafter(plan, logits=None, hidden_states=[-1], return_kv=not self.shared)
            rows = out.hidden[0].gather(1, idx[..., None].expand(-1, -1, out.hidden[0].shape[-1]))
            logits = dense(rows, self.draft_head)
            if drafter.config.logit_scale != 1.0:
                logits = logits * drafter.config.logit_scale
        else:
            out = drafter(plan, logits=idx, return_kv=not self.shared)
            logits = out.logits
        self.d_fwd += 1
        if not self.shared:
            commit = (self.d_start + plen) // self.bs * self.bs - self.d_start
            self.dcache.append(out.suffix_kv, counts=torch.from_numpy(commit))
            self.d_start += commit
        logits = logits.float()
        if self.draft_ids is not None:  # columns are draft_ids (no [MASK] among them)
            self._timed("draft", t0)
            return logits
        if Vd >= V:
            logits = logits[..., :V]
        else:
            logits = torch.cat([logits, logits.new_full((*logits.shape[:2], V - Vd), -math.inf)], -1)
        if self.mask_id < V:
            logits[..., self.mask_id] = -math.inf  # [MASK] is never a draft
        self._timed("draft", t0)
        return logits

    def search(self, logits, k: np.ndarray, draft, text, start, length):
        """The draft per request (into ``draft``): the causal-consistency path search over the
        token lattice (CPS), or each slot's choice cut after the first EOS; returns
        (drafted lengths [A], draft probabilities [A, kmax, V] when sampling)."""
        t0 = time.perf_counter()
        opts, V, eos, kmax = self.opts, self.V, self.eos, int(k.max())
        n_act = len(k)
        k_t = torch.from_numpy(k)
        draft_probs = None
        if opts["cps"]:
            cand_tok, cand_lp = build_lattice(
                logits,
                tau=opts["tau"],
                max_candidates=opts["max_candidates"],
                eos_ids=eos if self.draft_ids is None else self.eos_columns,
                temperature=self.temperature if self.sampling else 1.0,
            )
            require_finite(cand_tok[..., 0], "drafter")  # every finite row keeps its best candidate
            cand_tok = self._token_ids(cand_tok)
            # the last two committed tokens (-1 before the text's start)
            at = length[:, None] + np.array([-2, -1])
            hist = np.where(at >= 0, text[np.arange(n_act)[:, None], start[:, None] + np.maximum(at, 0)], -1)
            uniforms = None
            if self.sampling:  # the rows that draft (k > 0) draw, one uniform per slot
                uniforms = self.streams.uniforms(self.rows, kmax, advance=k > 0).cpu()
            res = path_search(
                cand_tok, cand_lp, k_t, hist, eos, self.lm, beam=opts["beam"], lam=opts["lam"], uniforms=uniforms
            )
            draft[:, :kmax] = res.tokens.clamp(min=0)
            n_draft = res.length.clone()
            if self.sampling:
                q = res.q.to(self.dev)
                ct = cand_tok.to(self.dev)
                draft_probs = torch.zeros(n_act, kmax, V, device=self.dev)
                draft_probs.scatter_add_(-1, ct.clamp(min=0), torch.where(ct >= 0, q, torch.zeros_like(q)))
        else:
            flat = logits.reshape(n_act * kmax, logits.shape[-1])
            if self.sampling:
                u = self.streams.uniforms(self.rows, kmax, advance=k > 0)
                choice = next_tokens(flat, self.temperature, uniforms=u.reshape(-1), who="drafter").view(n_act, kmax)
                draft_probs = torch.softmax(logits / self.temperature, dim=-1)
                if self.draft_ids is not None:
                    draft_probs = torch.zeros(n_act, kmax, V, device=self.dev).scatter_(
                        -1, self.draft_ids.expand(n_act, kmax, -1), draft_probs
                    )
            else:
                choice = require_finite(token_stats(flat).token, "drafter").view(n_act, kmax)
            choice = self._token_ids(choice).cpu()
            draft[:, :kmax] = choice
            # cut after the first EOS and at k
            slot = torch.arange(kmax)
            is_eos = torch.isin(choice, torch.tensor(eos or [-1])) & (slot[None] < k_t[:, None])
            first = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1) + 1, k_t)
            n_draft = torch.minimum(first, k_t)
        self._timed("search", t0)
        return n_draft, draft_probs

    def _token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of the drafter's logit columns (-1 stays -1)."""
        if self.draft_ids is None:
            return columns
        ids = self.draft_ids.to(columns.device)
        return torch.where(columns >= 0, ids[columns.clamp(min=0)], columns)

    def verify(self, text, start, length, draft, n_draft, draft_probs):
        """[last] + draft through the target in one forward, ``verify_chain``, and the target
        cache commit; returns (accepted drafts [A], tokens [A, L + 1]) on the host."""
        t0 = time.perf_counter()
        lmax = int(n_draft.max())
        last = torch.from_numpy(text[np.arange(len(length)), start + length - 1])
        seqs = torch.cat([last[:, None], draft[:, :lmax]], 1)
        out = self.model(self.model.plan(seqs, self.tcache, lengths=n_draft + 1), logits="all")
        self.t_fwd += 1
        dp = draft_probs[:, :lmax] if draft_probs is not None else None
        rand = self.streams.chain(self.rows, lmax) if self.sampling else {}
        ver = verify_chain(
            draft[:, :lmax].to(self.dev),
            out.logits,
            draft_probs=dp,
            num_drafts=n_draft.to(self.dev),
            temperature=self.temperature,
            **rand,
        )
        acc = ver.num_accepted.cpu()
        new_tok = ver.tokens.cpu()
        self.tcache.append(out.suffix_kv, counts=acc + 1)
        self._timed("verify", t0)
        return acc, new_tok

    def verify_tree(self, text, start, length, draft, n_draft):
        """:meth:`verify` with the draft and the prompt-lookup chain (``lookup``, greedy) as two
        branches of one prefix tree under the last committed token: one forward under the
        tree mask, ``verify_tree``, the accepted path committed."""
        t0 = time.perf_counter()
        n_act = len(length)
        last = text[np.arange(n_act), start + length - 1]
        chain, counts = suffix_match_drafts(text, length, offsets=start, min_ngram=MIN_NGRAM, num_drafts=self.lookup)
        width = max(draft.shape[1], chain.shape[1])
        branches = np.zeros((n_act, 2, width), dtype=np.int64)
        branches[:, 0, : draft.shape[1]] = draft.numpy()
        branches[:, 1, : chain.shape[1]] = np.maximum(chain, 0)
        tree = padded_prefix_tree(branches, np.stack([n_draft.numpy(), counts], 1), last, device=self.dev)
        positions = self.tcache.lengths.to(self.dev)[:, None] + tree.positions
        out = self.model(AttentionPlan(tree.tokens, positions, tree.words, self.tcache), logits="all")
        self.t_fwd += 1
        ver = verify_tree(tree.tokens, tree.parents, out.logits)
        acc, path = ver.num_accepted.cpu(), ver.path.cpu()
        self.tcache.append(out.suffix_kv, torch.cat([torch.zeros(n_act, 1, dtype=torch.int64), path], 1))
        self.lookup_nodes += int((tree.parents >= 0).sum()) - int(n_draft.sum())
        self._timed("verify", t0)
        return acc, ver.tokens.cpu()

    def commit(self, acc, new_tok, n_draft) -> np.ndarray:
        """Append each request's accepted drafts and drawn token; returns which rows are done."""
        acc, n = acc.numpy(), n_draft.numpy()
        if bool((new_tok.numpy()[np.arange(len(acc)), acc] < 0).any()):  # the drawn token: -1 marks a
            raise non_finite_error("target model")  # non-finite target row
        self.row_cycles += len(acc)
        self.committed_total += int(acc.sum()) + len(acc)
        self.drafted_total += int(n.sum())
        self.accepted_total += int(acc.sum())
        return self.outputs.extend(self.rows, new_tok.numpy(), acc + 1)

    def drop(self, done: np.ndarray) -> None:
        """Forget the rows ``done`` (bool [A]) in every per-row state and cache."""
        keep = np.flatnonzero(~done)
        self.rows = self.rows[keep]
        if not len(keep):
            return
        self.tcache = self.tcache.select(keep.tolist())
        if self.dcache is not None:
            self.dcache = self.dcache.select(keep.tolist())
        self.d_start = self.d_start[keep]
        if self.controller is not None:
            self.controller.select(keep)

    @property
    def generated(self) -> list[list[int]]:
        return self.outputs.generated

    def stats(self) -> dict:
        rows, opts = max(self.row_cycles, 1), self.opts
        return {
            "nfe": {"target": self.t_fwd, "drafter": self.d_fwd},
            "mean_accepted": self.committed_total / rows,
            "mean_accepted_drafts": self.accepted_total / rows,
            "mean_draft_len": self.drafted_total / rows,
            "acceptance_rate": self.accepted_total / max(self.drafted_total, 1),
            "cycles": self.cycles,
            "time_draft_s": self.time["draft"],
            "time_search_s": self.time["search"],
            "time_verify_s": self.time["verify"],
            "cps": opts["cps"],
            "adaptive": opts["adaptive"],
            "search_backend": _search_backend() if opts["cps"] else None,
            "draft_vocab": None if self.draft_ids is None else int(self.draft_ids.numel()),
            "shared_cache": self.shared,
            "lookup": self.lookup,
            "lookup_nodes": self.lookup_nodes / rows,
            "options": {**{k: v for k, v in opts.items() if k in OPTIONS}, "lookup": self.lookup},
        }


@torch.no_grad()
def decode_diffuspec(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_ids=(),
    progress=None,
    drafter=None,
    draft_len: int | None = None,
    adaptive: bool | None = None,
    cps: bool | None = None,
    beam: int | None = None,
    tau: float | None = None,
    max_candidates: int | None = None,
    lam: float | None = None,
    k_min: int | None = None,
    k_max: int | None = None,
    delta: int | None = None,
    rho: float | None = None,
    ngram=None,
    draft_vocab="auto",
    lookup: int | str | None = "auto",
):
    """DiffuSpec decoding of a ragged batch; returns (tokens per request, stats).

    Options (defaults: the paper's): ``draft_len`` (k when ``adaptive`` is False, 20; given
    alone it turns ADL off; with ``adaptive=True`` it is the first draft's length),
    ``adaptive`` (ADL, True), ``cps`` (path search, True), ``beam`` (3), ``tau`` (0.8),
    ``max_candidates`` (M_max, 15), ``lam`` (0.5), ``k_min`` / ``k_max`` (20 / 30), ``delta``
    (10) -- for a CPU model 4 / 12 / 2 unless one of the three is given (``CPU_ADL``) --,
    ``rho`` (0.5), ``ngram`` (the causal proxy: an ``NgramLM``, a path to a saved one,
    or None for :func:`dspec.decode.ngram.causal_proxy`: the shipped 3-gram of the target's own
    responses where there is one, else the corpora 3-gram; unused when ``lam = 1``),
    ``draft_vocab`` ("auto": on the CPU the drafter's shipped draft vocabulary, see
    :func:`resolve_draft_vocab`; None: the whole vocabulary; or the token ids to draft),
    ``lookup`` (greedy only: verify the searched draft as a token tree with a prompt-lookup
    chain of up to K tokens grafted on, :mod:`dspec.decode.lookup`; "auto": 7 for a CPU model
    decoding greedily at most 4 requests, else off; None / 0: off; ADL then sizes the draft
    by the dLLM draft's own accepted prefix).

    Bounds (:mod:`dspec.decode.bounds`): ``draft_len``, ``k_min``, ``k_max`` and ``lookup`` at
    most ``MAX_DRAFT_LEN``, ``beam`` at most ``MAX_BEAM`` (``max_candidates`` is capped by the
    vocabulary); the longest prompt + the drafter's block size + 2 k + 1 (+ ``lookup``) must
    fit the target's and the drafter's ``max_position_embeddings``, k = ``k_max`` with ADL, else
    ``draft_len`` (what one drafter forward and one verification carry at most).

    Stats: ``nfe`` {"target": verify forwards + prefill, "drafter": draft forwards};
    ``mean_accepted``: tokens committed per request per target verification forward
    (accepted drafts + the verify's own token, averaged over every (request, cycle) pair in
    which the request was still decoding; AR = 1); ``mean_draft_len`` (drafted tokens per
    request per cycle), ``mean_accepted_drafts``, ``cycles``, ``time_draft_s`` (drafter
    forwards), ``time_search_s`` (lattice + path search), ``time_verify_s`` (target forwards,
    verification, commits).
    """
    if k_min is None and k_max is None and delta is None and model.device.type == "cpu":
        k_min, k_max, delta = CPU_ADL["k_min"], CPU_ADL["k_max"], CPU_ADL["delta"]
    opts = _options(
        draft_len,
        adaptive,
        cps=cps,
        beam=beam,
        tau=tau,
        max_candidates=max_candidates,
        lam=lam,
        k_min=k_min,
        k_max=k_max,
        delta=delta,
        rho=rho,
    )
    controller = None
    if opts["adaptive"]:
        controller = AdaptiveDraftLength(
            len(prompts),
            k_min=opts["k_min"],
            k_max=opts["k_max"],
            delta=opts["delta"],
            rho=opts["rho"],
            k_init=draft_len,
        )
    lookup = resolve_lookup(model, lookup, tree=temperature <= 0, temperature=temperature, batch=len(prompts))
    drafter = resolve_drafter(model, drafter)
    # the context bound: the drafter forwards its pending tokens (< its block size + the last
    # cycle's k + 1) and k [MASK] slots, the target the last token, the draft and the lookup chain
    k = max(opts["k_max"], opts["k_min"]) if opts["adaptive"] else opts["draft_len"]
    name = (
        ("k_max" if k_max is not None else "draft_len" if draft_len is not None else "drafter")
        if opts["adaptive"]
        else "draft_len"
    )
    check_rows(
        model,
        prompts,
        name,
        k,
        drafter.block_size + 2 * k + 1 + (lookup or 0),
        f"the drafter's block size + 2 * {'k_max' if opts['adaptive'] else 'draft_len'} + 1"
        + (" + lookup" if lookup else ""),
        drafter=drafter,
    )
    lm = _causal_proxy(model, opts, ngram)
    draft_ids = resolve_draft_vocab(model, drafter, draft_vocab, eos_ids)
    # the drafter's weight table checked once for the call, as generate does for the target's
    with frozen_weights(drafter):
        run = DiffuSpecRun(
            model,
            drafter,
            prompts,
            opts,
            lm,
            controller,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
            eos_ids=eos_ids,
            progress=progress,
            draft_ids=draft_ids,
            lookup=lookup,
        )
        while run.active and run.cycle():
            pass
    return run.generated, run.stats()


def _search_backend() -> str:
    from .path_search import cpp_available

    return "cpp" if cpp_available() else "python"


decode = decode_diffuspec

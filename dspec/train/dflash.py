"""Training recipe of the DFlash block drafter (and, with a prefix prior, of D2SD's VP-drafter).

Data: **target-generated responses**.  Prompts come from ``dspec.tasks`` (arithmetic
problems, the starts of standard-library files, ShareGPT turns; an instruct target with a
ChatML tokenizer gets them in its chat template) and the target itself continues each one
with dspec's ``ar`` (greedy for most, sampled at T = 1 for the rest), so the drafter learns
the distribution it must predict at decoding time.  The sequences are generated once and
stored in the output directory (``data.pt``, reused on resume); a fixed tenth is held out.

Objective (one optimizer step): for B sequences, one no-grad target forward gives the hidden
states at the drafter's ``target_layer_ids``; M anchor positions p per sequence are drawn in
the response (p >= prompt length, as in decoding where the first anchor is the first
generated token); block m is ``[x_p, x_{p+1} .. x_{p+i}, MASK ...]`` of G slots, where i =
0 for DFlash and i ~ the truncated geometric prefix prior for the VP-drafter
(:func:`dspec.train.vp_drafter.prefix_prior`); it sees the target features of positions
< p.  Loss: cross-entropy of slot j against x_{p+j} for j > i, weighted by
``exp(-(j - i - 1) / decay)`` (:func:`dspec.models.dflash.block_loss_weights`: the first
drafted slot weighs 1, later ones less, as a later slot only counts when all before it are
accepted), normalised by the weight sum; slots past the sequence end weigh 0.

VP prefixes at DFlash's own rejections (``prefix_mode="rejection"``, :func:`rejection_prefixes`):
D2SD's re-draft at boundary i changes the output only in cycles where the first draft is
rejected exactly at slot i + 1, and then its draft there is known to be wrong.  So each
block is first drafted by the frozen DFlash drafter (no grad, the same target features);
the VP-drafter gets i = the drafts it had accepted and learns slots > i with the rejected
draft's logit removed at slot i + 1 (as :func:`dspec.decode.d2sd.redraft` bans it at decode
time); blocks the first draft gets wholly right, or that end before its rejection, weigh 0.

Optimisation: AdamW, linear warmup + cosine decay, gradient clipping; bf16 autocast on CUDA
and on CPUs with native bf16 matmul;
a time budget (``--minutes``) fixes the total step count after a few measured steps;
checkpoints (``checkpoint.pt``: drafter, optimizer, step, schedule, log) every
``checkpoint_every_s`` and at the end, and ``--resume`` continues the same schedule
(batches and anchors are seeded by (seed, step)).  tqdm progress; ``train_log.json`` and
``loss_curve.png``.  The final drafter directory (``OUT/drafter``: config.json,
model.safetensors, README.md model card with data, steps, wall time, held-out loss and the
measured acceptance length) loads with :func:`dspec.models.dflash.load_drafter`.

CLI::

    python -m dspec.train.dflash --target tiny-ar --out runs/tiny-ar-dflash --minutes 12
    python -m dspec.train.vp_drafter --target tiny-ar --out runs/tiny-ar-vp --minutes 12
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .._cli import dumps, run_command
from ..decode.dflash import draft_columns, vocab_ids
from ..models.dflash import MASK, BlockDrafter, block_loss_weights
from .data_engine import heldout_split, parse_source_weights
from .loop import BudgetedLoop
from .trainer import lr_at

CHECKPOINT = "checkpoint.pt"
DATA = "data.pt"
LOG_JSON = "train_log.json"
LOSS_PNG = "loss_curve.png"
PROMPT_SOURCES = ("arithmetic", "stdlib", "sharegpt")


CHECKPOINT_KEYS = ("drafter", "opt", "step", "total_steps", "log", "evals", "wall_s")


def read_checkpoint(path, *, map_location="cpu") -> dict:
    """A drafter run's ``checkpoint.pt``, read without running code from it
    (:func:`dspec.train.state_files.load_state`); ValueError when it is not one."""
    from .state_files import load_state

    return load_state(path, f"resume: {CHECKPOINT}", keys=CHECKPOINT_KEYS, map_location=map_location)


def load_data(path, what: str) -> dict:
    """A run's ``data.pt`` ({"sequences": [(token ids, prompt length), ...], "info": {...}}),
    read without running code from it; ValueError when it is not one."""
    from .state_files import load_state

    blob = load_state(path, what, keys=("sequences", "info"))
    seqs = blob["sequences"]
    if (
        not isinstance(seqs, (list, tuple))
        or not isinstance(blob["info"], dict)
        or not all(isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[1], int) for s in seqs)
    ):
        raise ValueError(
            f"{what}: {path} does not hold training sequences ([(token ids, prompt length), ...] and an info dict)"
        )
    return blob


# ------------------------------------------------------------------------------ config


@dataclass
class DrafterTrainConfig:
    """Recipe settings.

    kind : "dflash" or "vp".
    block_size : G, slots per block (anchor included); 16 at scale, 8 for tiny targets.
    num_layers : drafter depth; target_layer_ids : None = evenly spread default.
    batch_size : sequences per step; anchors_per_seq : blocks M drawn per sequence.
    lr, min_lr, warmup_steps, max_steps, weight_decay, grad_clip : AdamW + cosine schedule.
    loss_decay : the decay of the slot weights exp(-(j - i - 1) / decay) (None: G / 2).
    prefix_accept : VP prefix prior parameter a, P(i) proportional to a^i on [0, G-2].
    prefix_mode : (vp) "prior" (i from the prefix prior) or "rejection" (i where a frozen
        DFlash drafter's greedy draft is first rejected; the trainer is given that drafter).
    num_prompts, prompt_tokens, response_tokens, sampled_fraction, gen_batch : data
        generation (prompts, max prompt length, tokens generated per prompt, fraction of
        responses sampled at T = 1, batch of the ``ar`` generation).
    sources : prompt sources (``PROMPT_SOURCES``) and their weights.
    heldout_fraction : fraction of sequences held out; heldout_start : hold out only sequences
        from this index on (a later round on grown data: the earlier sequence count).
    new_weight : training sequences from ``heldout_start`` on (the directories a later round
        appends) are drawn ``new_weight`` times as often as the earlier ones (an int >= 1).
    draft_vocab : train and draft over the ``draft_vocab`` most frequent response tokens of
        the training split (EAGLE-3's reduced head; slots whose label lies outside weigh 0);
        0 = the whole vocabulary.
    eval_every : steps between held-out evaluations; checkpoint_every_s : seconds.
    autocast : "auto" (bf16 on CUDA and on CPUs with native bf16 matmul), "bf16" or "none".
    """

    kind: str = "dflash"
    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: list | None = None
    batch_size: int = 16
    anchors_per_seq: int = 8
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    max_steps: int = 20000
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_decay: float | None = None
    prefix_accept: float = 0.7
    prefix_mode: str = "prior"
    num_prompts: int = 2048
    prompt_tokens: int = 48
    response_tokens: int = 64
    sampled_fraction: float = 0.25
    gen_batch: int = 64
    sources: dict = field(default_factory=lambda: {"arithmetic": 0.3, "stdlib": 0.4, "sharegpt": 0.3})
    heldout_fraction: float = 0.1
    heldout_start: int = 0
    new_weight: int = 1
    draft_vocab: int = 0
    eval_every: int = 100
    checkpoint_every_s: float = 120.0
    autocast: str = "auto"
    seed: int = 0
    qk_norm: bool = False
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.kind not in ("dflash", "vp"):
            raise ValueError(f"kind must be 'dflash' or 'vp', got {self.kind!r}")
        for name in (
            "block_size",
            "num_layers",
            "batch_size",
            "anchors_per_seq",
            "max_steps",
            "num_prompts",
            "prompt_tokens",
            "response_tokens",
            "gen_batch",
            "eval_every",
            "new_weight",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 < self.prefix_accept < 1:
            raise ValueError(f"prefix_accept must lie in (0, 1), got {self.prefix_accept}")
        if self.prefix_mode not in ("prior", "rejection"):
            raise ValueError(f"prefix_mode must be 'prior' or 'rejection', got {self.prefix_mode!r}")
        if self.prefix_mode == "rejection" and self.kind != "vp":
            raise ValueError("prefix_mode='rejection' trains a VP drafter: kind must be 'vp'")
        if not 0 <= self.sampled_fraction <= 1 or not 0 < self.heldout_fraction < 1:
            raise ValueError("sampled_fraction must lie in [0, 1] and heldout_fraction in (0, 1)")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be 'auto', 'bf16' or 'none', got {self.autocast!r}")
        for name in ("heldout_start", "draft_vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm must be a bool, got {self.qk_norm!r}")
        m = self.mask_token_id
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"mask_token_id must be None or a token id >= 0, got {m!r}")
        bad = set(self.sources) - set(PROMPT_SOURCES)
        if bad or not self.sources or sum(self.sources.values()) <= 0:
            raise ValueError(f"sources must map some of {PROMPT_SOURCES} to weights, got {self.sources!r}")

    @property
    def decay(self) -> float:
        return float(self.loss_decay) if self.loss_decay else self.block_size / 2


# -------------------------------------------------------------------------------- data


def _chat(tokenizer, text: str) -> str:
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return f"<|im_start|>user\n{text.strip()}<|im_end|>\n<|im_start|>assistant\n"
    return text


def make_prompts(target, cfg: DrafterTrainConfig) -> list[list[int]]:
    """``cfg.num_prompts`` prompt token lists drawn from ``cfg.sources`` (deterministic in
    ``cfg.seed``); arithmetic problems use training seeds (>= 1000), text sources are cut
    at a line start and truncated to ``cfg.prompt_tokens`` tokens."""
    from .. import tasks

    tok = target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer: pass prompts as token ids (generate_sequences)")
    rng = random.Random(cfg.seed)
    total = sum(cfg.sources.values())
    counts = {s: int(round(cfg.num_prompts * w / total)) for s, w in cfg.sources.items()}
    texts: list[str] = []
    if counts.get("arithmetic"):
        texts += [p.prompt for p in tasks.arithmetic(counts["arithmetic"], seed=1000 + cfg.seed)]
    if counts.get("stdlib"):
        files = tasks.stdlib_sources()
        for _ in range(counts["stdlib"]):
            src = files[rng.randrange(len(files))].read_text(encoding="utf-8", errors="replace")
            lines = src.splitlines(keepends=True)
            start = rng.randrange(max(1, len(lines) - 8)) if lines else 0
            texts.append("".join(lines[start : start + 12]) or "import os\n")
    if counts.get("sharegpt"):
        turns = []
        for t in tasks.sharegpt_texts(max_conversations=4 * counts["sharegpt"], roles=("human",)):
            turns.append(t)
        rng.shuffle(turns)
        texts += [_chat(tok, t[:600]) for t in turns[: counts["sharegpt"]]]
    rng.shuffle(texts)
    prompts = []
    for t in texts:
        ids = tok.encode(t)[: cfg.prompt_tokens]
        if ids:
            prompts.append(ids)
    return prompts


@torch.no_grad()
def generate_sequences(target, prompts: list[list[int]], cfg: DrafterTrainConfig, *, progress: bool = True):
    """Continue every prompt with the target (``ar``): greedy, or sampled at T = 1 for a
    ``cfg.sampled_fraction`` share.  Returns a list of (token ids, prompt length)."""
    from tqdm.auto import tqdm

    from ..decode.ar import decode_ar

    out = []
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    n_sampled = int(round(len(prompts) * cfg.sampled_fraction))
    bar = tqdm(total=len(prompts), desc="generating responses", unit="seq", disable=not progress)
    for start in range(0, len(prompts), cfg.gen_batch):
        chunk = prompts[start : start + cfg.gen_batch]
        sampled = start >= len(prompts) - n_sampled
        tokens, _ = decode_ar(
            target,
            chunk,
            max_new_tokens=cfg.response_tokens,
            temperature=1.0 if sampled else 0.0,
            generator=gen if sampled else None,
            eos_ids=target.eos_token_ids,
        )
        for p, t in zip(chunk, tokens):
            if len(t) >= 2:
                out.append((list(p) + list(t), len(p)))
        bar.update(len(chunk))
    bar.close()
    return out


# ---------------------------------------------------------------------------- batches


def pad_sequences(seqs, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(ids, prompt_len)] -> tokens [B, T] (right-padded with 0), lengths [B], prompt_lens [B]."""
    t = max(len(s) for s, _ in seqs)
    tokens = torch.zeros(len(seqs), t, dtype=torch.int64)
    for b, (s, _) in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s, _ in seqs])
    plens = torch.tensor([p for _, p in seqs])
    return tokens.to(device), lengths.to(device), plens.to(device)


def make_blocks(
    tokens,
    lengths,
    prompt_lens,
    *,
    block_size: int,
    anchors: int,
    prefix_lengths=None,
    generator: torch.Generator | None = None,
):
    """Draw ``anchors`` anchor positions per sequence in [prompt_len, length - 2] and build
    the training blocks.

    Returns blocks [B, M, G] (slot 0 the anchor token, slots 1..i the given prefix, MASK
    after), labels [B, M, G] (x_{p+j}, 0 past the end), valid [B, M, G] (label exists),
    starts [B, M] (the anchor positions), prefix [B, M] (i; zeros without
    ``prefix_lengths``, an int tensor [B, M] sampled by the caller).
    """
    bsz, t = tokens.shape
    dev = tokens.device
    lo = prompt_lens.clamp_max(lengths - 2).clamp_min(0)
    span = (lengths - 1 - lo).clamp_min(1)
    u = torch.rand(bsz, anchors, generator=generator).to(dev)
    starts = lo[:, None] + (u * span[:, None]).long().clamp_max(span[:, None] - 1)
    j = torch.arange(block_size, device=dev)
    pos = starts[..., None] + j  # [B, M, G]
    valid = pos < lengths[:, None, None]
    gathered = tokens.gather(1, pos.clamp_max(t - 1).view(bsz, -1)).view(bsz, anchors, block_size)
    labels = torch.where(valid, gathered, torch.zeros_like(gathered))
    prefix = (
        torch.zeros(bsz, anchors, dtype=torch.int64, device=dev) if prefix_lengths is None else prefix_lengths.to(dev)
    )
    given = (j <= prefix[..., None]) & valid
    blocks = torch.where(given, labels, torch.full_like(labels, MASK))
    valid = valid & (j > prefix[..., None])
    return blocks, labels, valid, starts, prefix


def target_hidden(target, tokens: torch.Tensor, layer_ids) -> list[torch.Tensor]:
    """The frozen target's hidden states of ``tokens`` [B, T] at ``layer_ids`` (no grad)."""
    # the frozen target runs in its own dtype (autocast would hand bf16 to its fp32 kernels)
    with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
        plan = target.plan(tokens)
        return target(plan, logits=None, hidden_states=layer_ids, return_kv=False).hidden


def ban_tokens(
    logits: torch.Tensor, prefix: torch.Tensor, banned: torch.Tensor, draft_index: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` [B, M, G, V] with token ``banned[b, m]`` (a target id; -1 none) removed at
    slot ``prefix[b, m] + 1``, the first re-drafted slot (-inf; a copy).  ``draft_index``: the
    logits cover a draft vocabulary (a banned id outside it has no column to remove)."""
    col = banned if draft_index is None else torch.where(banned >= 0, draft_index[banned.clamp_min(0)], -1)
    g, v = logits.shape[-2], logits.shape[-1]
    at_slot = torch.arange(g, device=logits.device) == (prefix + 1)[..., None]  # [B, M, G]
    hit = (torch.arange(v, device=logits.device) == col[..., None]) & (col >= 0)[..., None]  # [B, M, V]
    return logits.masked_fill(at_slot[..., None] & hit[:, :, None, :], float("-inf"))


def block_loss(
    drafter: BlockDrafter,
    target,
    tokens,
    lengths,
    blocks,
    labels,
    valid,
    starts,
    prefix,
    decay: float,
    hidden: list[torch.Tensor] | None = None,
    *,
    draft_index: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    return_logits: bool = False,
):
    """Weighted cross-entropy of a batch of blocks (the recipe's objective) -> (loss, weight sum)
    (+ the logits with ``return_logits``).  ``hidden``: the target's hidden states of
    ``tokens`` when cached (else one target forward).  ``draft_index``: int64 [V], a target
    id's column in the drafter's draft vocabulary (-1 outside): the logits cover only the
    draft vocabulary and slots labelled outside it weigh 0.  ``banned``: int64 [B, M], a
    target id excluded at slot prefix + 1 (:func:`ban_tokens`; -1 none)."""
    if hidden is None:
        hidden = target_hidden(target, tokens, drafter.target_layer_ids)
    logits = drafter.forward_train(hidden, blocks, starts, context_length=lengths, draft_vocab=draft_index is not None)
    if banned is not None:
        logits = ban_tokens(logits, prefix, banned, draft_index)
    if draft_index is not None:
        labels = draft_index[labels]
        valid = valid & (labels >= 0)
        labels = labels.clamp_min(0)
    w = block_loss_weights(blocks.shape[-1], prefix, decay) * valid
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    total = w.sum()
    # a weight-0 slot may hold -inf at its (clamped) label: a banned column; inf * 0 is nan
    loss = (ce.masked_fill(w == 0, 0.0) * w).sum() / total.clamp_min(1e-6)
    return (loss, total, logits) if return_logits else (loss, total)


def greedy_accepted(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    prefix: torch.Tensor,
    draft_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced greedy acceptance of a batch of blocks.

    Slot j's draft is the logits' argmax (a column of ``draft_ids`` [V'] when the logits
    cover a draft vocabulary); it is *accepted* when it equals the label and every drafted
    slot before it (j > prefix) was accepted: on target-greedy sequences this is what greedy
    verification commits at that anchor (the drafted slots of a block are conditionally
    independent given the context, so teacher forcing is exact there).

    Returns (accepted [B, M] int64: leading accepted drafted slots, stopped by a wrong slot
    or the sequence end; correct [B, M, G] bool: slot-wise top-1 agreement, ``valid`` only).
    """
    pred = vocab_ids(logits.argmax(-1), draft_ids)
    g = labels.shape[-1]
    drafted = torch.arange(g, device=labels.device) > prefix[..., None]
    correct = (pred == labels) & valid
    run = torch.where(drafted, correct, torch.ones_like(correct)).long().cumprod(-1).bool()
    return (run & drafted).sum(-1), correct


@torch.no_grad()
def rejection_prefixes(
    first_drafter: BlockDrafter, hidden, lengths, blocks, labels, valid, starts, *, return_logits: bool = False
):
    """Where a (DFlash) first drafter's greedy draft of each block is first rejected.

    ``blocks``, ``labels``, ``valid``, ``starts``: :func:`make_blocks` output with prefix 0
    (the first draft's input).  Returns (prefix [B, M]: the drafts accepted before the first
    rejection, clamped to G - 2; rejected [B, M]: the first drafter's token at the rejected
    slot (a target id); has [B, M] bool: the block has a rejection inside the sequence --
    False where every draft is right or the sequence ends first) (+ the first drafter's logits
    [B, M, G, V'] with ``return_logits``)."""
    g = blocks.shape[-1]
    logits = first_drafter.forward_train(
        hidden, blocks, starts, context_length=lengths, draft_vocab=first_drafter.draft_vocab is not None
    )
    ids = first_drafter.draft_vocab
    zero = torch.zeros_like(starts)
    accepted, _ = greedy_accepted(logits, labels, valid, zero, ids)
    slot = (accepted + 1).clamp_max(g - 1)[..., None]
    has = (accepted < g - 1) & valid.gather(-1, slot).squeeze(-1)
    rejected = vocab_ids(logits.argmax(-1), ids).gather(-1, slot).squeeze(-1)
    out = (accepted.clamp_max(g - 2), rejected, has)
    return out + (logits,) if return_logits else out


# ---------------------------------------------------------------------------- trainer


class DrafterTrainer(BudgetedLoop):
    """Trains one block drafter for one target (see the module docstring).

    Parameters
    ----------
    target : the AR target (frozen).
    cfg : DrafterTrainConfig.
    out_dir : where data, checkpoints, logs and the final drafter go.
    sequences : optional pre-generated [(ids, prompt_len)] (otherwise generated or read
        from ``out_dir/data.pt``).
    prefix_sampler : callable(generator, shape) -> prefix lengths int64 (the VP prior);
        None for DFlash (i = 0).
    first_drafter : (``prefix_mode="rejection"``) the frozen DFlash drafter whose rejections
        place the VP prefixes (:func:`rejection_prefixes`); same block size and target layers.
    features : a directory for the target's hidden states of every sequence, computed once
        (:mod:`dspec.train.features`; built or resumed here); None re-runs the target in
        every step.
    """

    @property
    def progress_desc(self) -> str:
        return f"train {self.cfg.kind} drafter"

    def __init__(
        self,
        target,
        cfg: DrafterTrainConfig,
        out_dir,
        *,
        sequences=None,
        prefix_sampler=None,
        first_drafter=None,
        features=None,
        progress: bool = True,
    ):
        if (cfg.prefix_mode == "rejection") != (first_drafter is not None):
            raise ValueError("first_drafter: given exactly when cfg.prefix_mode is 'rejection'")
        if first_drafter is not None:
            fc = first_drafter.config
            if fc.block_size != cfg.block_size:
                raise ValueError(f"first_drafter: block size {fc.block_size}, the recipe's {cfg.block_size}")
            want = cfg.target_layer_ids
            if want is not None and list(fc.target_layer_ids) != list(want):
                raise ValueError(f"first_drafter: target layers {fc.target_layer_ids}, the recipe's {want}")
            first_drafter = first_drafter.requires_grad_(False).eval()
        self.first_drafter = first_drafter
        self.target = target.requires_grad_(False).eval()
        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.prefix_sampler = prefix_sampler
        self.device = target.device
        self.drafter = BlockDrafter.for_target(
            target,
            kind=cfg.kind,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=(
                cfg.target_layer_ids or (first_drafter.config.target_layer_ids if first_drafter is not None else None)
            ),
            seed=cfg.seed,
            qk_norm=cfg.qk_norm,
            mask_token_id=cfg.mask_token_id,
        )
        self.drafter.float().train()
        self.data_info = {}
        self.sequences = self._data(sequences)
        n_held = max(1, int((len(self.sequences) - cfg.heldout_start) * cfg.heldout_fraction))
        self.held_idx, self.train_idx = heldout_split(
            len(self.sequences), n_held, seed=cfg.seed, start=cfg.heldout_start
        )
        self.train_idx = self.train_idx or self.held_idx
        # oversampling repeats the new indices: the draw stays one uniform pick over a list
        self.train_idx = self.train_idx + [i for i in self.train_idx if i >= cfg.heldout_start] * (cfg.new_weight - 1)
        self.heldout = [self.sequences[i] for i in self.held_idx]
        self.train_set = [self.sequences[i] for i in self.train_idx]
        self.draft_index = None
        if cfg.draft_vocab:
            self.use_draft_vocab(
                draft_vocabulary(self.train_set, cfg.draft_vocab, target.config.vocab_size, always=target.eos_token_ids)
            )
        self.features = None
        if features is not None:
            from .features import build_features

            self.features = build_features(
                self.target, self.sequences, self.drafter.target_layer_ids, features, progress=progress
            )
        decay_params = [p for n, p in self.drafter.named_parameters() if p.dim() >= 2]
        other = [p for n, p in self.drafter.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay_params, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        self.step = 0
        self.total_steps = None
        self.log: list[dict] = []
        self.evals: list[dict] = []
        self.wall_s = 0.0

    def use_draft_vocab(self, ids: torch.Tensor) -> None:
        """Train and evaluate over draft vocabulary ``ids`` (int64 [V'] target ids): the
        drafter's head and ``draft_index`` (a target id's column, -1 outside)."""
        self.drafter.set_draft_vocab(ids)
        self.draft_index = draft_columns(ids.cpu(), self.target.config.vocab_size).to(self.device)

    # ------------------------------------------------------------------ data
    def _data(self, sequences):
        path = self.out / DATA
        if sequences is not None:
            self.data_info = {"source": "given", "sequences": len(sequences)}
            return [(list(s), int(p)) for s, p in sequences]
        if path.is_file():
            blob = load_data(path, DATA)
            self.data_info = blob["info"]
            return blob["sequences"]
        t0 = time.perf_counter()
        prompts = make_prompts(self.target, self.cfg)
        seqs = generate_sequences(self.target, prompts, self.cfg, progress=self.progress)
        if not seqs:
            raise ValueError("the target generated no usable responses (all shorter than 2 tokens)")
        self.data_info = {
            "source": "target-generated (dspec ar)",
            "prompts": len(prompts),
            "sequences": len(seqs),
            "sources": dict(self.cfg.sources),
            "tokens": sum(len(s) for s, _ in seqs),
            "response_tokens": sum(len(s) - p for s, p in seqs),
            "sampled_fraction": self.cfg.sampled_fraction,
            "generation_s": round(time.perf_counter() - t0, 1),
        }
        torch.save({"sequences": seqs, "info": self.data_info}, path)
        return seqs

    def _gen(self, step: int, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 7919 + salt)

    def batch(self, step: int, indices=None, *, salt: int = 0):
        """Step ``step``'s sequences and blocks (a pure function of (seed, step)); ``indices``
        (into ``self.sequences``) fixes the sequences.  Returns (tokens, lengths, blocks,
        labels, valid, starts, prefix, hidden, banned) with ``hidden`` None without a feature
        cache (and no first drafter) and ``banned`` None outside the rejection mode."""
        g = self._gen(step, salt)
        if indices is None:
            pick = torch.randint(len(self.train_idx), (self.cfg.batch_size,), generator=g).tolist()
            indices = [self.train_idx[i] for i in pick]
        rows = [self.sequences[i] for i in indices]
        tokens, lengths, plens = pad_sequences(rows, self.device)
        prefix = None
        if self.prefix_sampler is not None:
            prefix = self.prefix_sampler(g, (len(rows), self.cfg.anchors_per_seq))
        hidden = None if self.features is None else self.features.gather(indices, tokens.shape[1], self.device)
        blocks, labels, valid, starts, prefix = make_blocks(
            tokens,
            lengths,
            plens,
            block_size=self.cfg.block_size,
            anchors=self.cfg.anchors_per_seq,
            prefix_lengths=prefix,
            generator=g,
        )
        banned = None
        if self.first_drafter is not None:
            if hidden is None:
                hidden = target_hidden(self.target, tokens, self.drafter.target_layer_ids)
            with self._autocast():
                prefix, banned, has = rejection_prefixes(
                    self.first_drafter, hidden, lengths, blocks, labels, valid, starts
                )
            j = torch.arange(self.cfg.block_size, device=blocks.device)
            in_range = valid | (j == 0)  # the anchor is always inside the sequence
            blocks = torch.where((j <= prefix[..., None]) & in_range, labels, torch.full_like(labels, MASK))
            valid = in_range & (j > prefix[..., None]) & has[..., None]
            banned = torch.where(has, banned, -1)
        return tokens, lengths, blocks, labels, valid, starts, prefix, hidden, banned

    # ------------------------------------------------------------------ steps
    def _autocast(self):
        from ..cpu import native_bf16

        auto = self.device.type == "cuda" or (self.device.type == "cpu" and native_bf16())
        on = self.cfg.autocast == "bf16" or (self.cfg.autocast == "auto" and auto)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=on)

    def train_step(self) -> float:
        cfg = self.cfg
        lr = lr_at(self.step, cfg, self.total_steps or cfg.max_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        tokens, lengths, blocks, labels, valid, starts, prefix, hidden, banned = self.batch(self.step)
        with self._autocast():
            loss, _ = block_loss(
                self.drafter,
                self.target,
                tokens,
                lengths,
                blocks,
                labels,
                valid,
                starts,
                prefix,
                cfg.decay,
                hidden,
                draft_index=self.draft_index,
                banned=banned,
            )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        value = float(loss.detach())
        self.log.append({"step": self.step, "loss": value, "lr": lr})
        return value

    @torch.no_grad()
    def evaluate(self, max_sequences: int = 64) -> float:
        """Held-out weighted loss over fixed anchors (seeded, identical across calls); the
        record also holds ``heldout_accepted`` (teacher-forced greedy tokens per cycle,
        accepted drafts + 1, :func:`greedy_accepted`) and ``slot_accuracy`` (top-1 agreement
        of drafted slots 1..G-1).  In the rejection mode both count only blocks with a
        rejection (``heldout_accepted`` is then the tokens a re-draft at the true rejection
        boundary commits: its accepted slots + the target's own token) and the record adds
        ``rejected_fraction``, the share of blocks the first draft gets wrong in range."""
        self.drafter.eval()
        total, weight = 0.0, 0.0
        accepted, blocks_seen, blocks_all = 0, 0, 0
        g = self.cfg.block_size
        hits, counts = torch.zeros(g), torch.zeros(g)
        held = self.held_idx[:max_sequences]
        for start in range(0, len(held), self.cfg.batch_size):
            tokens, lengths, blocks, labels, valid, starts, prefix, hidden, banned = self.batch(
                start, held[start : start + self.cfg.batch_size], salt=99991
            )
            with self._autocast():
                loss, w, logits = block_loss(
                    self.drafter,
                    self.target,
                    tokens,
                    lengths,
                    blocks,
                    labels,
                    valid,
                    starts,
                    prefix,
                    self.cfg.decay,
                    hidden,
                    draft_index=self.draft_index,
                    banned=banned,
                    return_logits=True,
                )
            total += float(loss) * float(w)
            weight += float(w)
            acc, correct = greedy_accepted(
                logits, labels, valid, prefix, self.drafter.draft_vocab if self.draft_index is not None else None
            )
            accepted += int(acc.sum())
            blocks_seen += acc.numel() if banned is None else int((banned >= 0).sum())
            blocks_all += acc.numel()
            hits += correct.sum((0, 1)).cpu()
            counts += valid.sum((0, 1)).cpu()
        self.drafter.train()
        value = total / max(weight, 1e-6)
        self.evals.append(
            {
                "step": self.step,
                "heldout_loss": value,
                "heldout_accepted": 1 + accepted / max(blocks_seen, 1),
                "slot_accuracy": [round(float(h / c), 4) if c else None for h, c in zip(hits[1:], counts[1:])],
                **({"rejected_fraction": blocks_seen / max(blocks_all, 1)} if self.first_drafter is not None else {}),
            }
        )
        return value

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "drafter": self.drafter.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "total_steps": self.total_steps,
            "log": self.log,
            "evals": self.evals,
            "wall_s": self.wall_s,
            "cfg": asdict(self.cfg),
        }

    def save_checkpoint(self) -> Path:
        path = self.out / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        self.write_log()
        return path

    def init_from(self, path_or_name) -> None:
        """Warm start: the weights of a saved drafter (either kind: a DFlash drafter is a good
        start for a VP drafter) of the same shape, or of the same shape with fewer layers
        (deepening: its layers become the first ones and every added layer starts as the
        identity -- its o_proj and down_proj zero, so the drafter's output is unchanged at
        step 0 and the new layers learn only a correction); ValueError when the shapes differ
        otherwise."""
        from ..models.dflash import load_drafter

        src = load_drafter(path_or_name, self.target, device=self.device, dtype=torch.float32)
        mine, theirs = self.drafter.config, src.config
        for f in (
            "block_size",
            "target_layer_ids",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(mine, f) != getattr(theirs, f):
                raise ValueError(
                    f"init: {path_or_name} has {f} = {getattr(theirs, f)!r}, this recipe {getattr(mine, f)!r}"
                )
        if theirs.num_layers > mine.num_layers:
            raise ValueError(
                f"init: {path_or_name} has num_layers = {theirs.num_layers}, more than this recipe's {mine.num_layers}"
            )
        missing, unexpected = self.drafter.load_state_dict(src.state_dict(), strict=False)
        added = [f"layers.{i}." for i in range(theirs.num_layers, mine.num_layers)]
        if unexpected or any(not k.startswith(tuple(added)) for k in missing):
            raise ValueError(
                f"init: {path_or_name} does not match this drafter's parameters "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        with torch.no_grad():
            for layer in list(self.drafter.layers)[theirs.num_layers :]:
                layer.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        self.data_info = dict(
            self.data_info,
            init=str(path_or_name),
            **({"init_layers": theirs.num_layers} if theirs.num_layers < mine.num_layers else {}),
        )

    def resume(self, state: dict | None = None) -> bool:
        """Load ``checkpoint.pt`` when present (or ``state``, read earlier by
        :func:`read_checkpoint`); True if it did."""
        if state is None:
            path = self.out / CHECKPOINT
            if not path.is_file():
                return False
            state = read_checkpoint(path, map_location=self.device)
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.log, self.evals, self.wall_s = state["log"], state["evals"], state["wall_s"]
        return True

    def write_log(self) -> None:
        (self.out / LOG_JSON).write_text(
            dumps(
                {
                    "config": asdict(self.cfg),
                    "data": self.data_info,
                    "step": self.step,
                    "total_steps": self.total_steps,
                    "wall_s": self.wall_s,
                    "train": self.log,
                    "heldout": self.evals,
                },
                indent=1,
            )
        )
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # plots are optional
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        if self.log:
            ax.plot([r["step"] for r in self.log], [r["loss"] for r in self.log], lw=0.8, label="train")
        if self.evals:
            ax.plot([r["step"] for r in self.evals], [r["heldout_loss"] for r in self.evals], "o-", label="held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("weighted block cross-entropy (nats)")
        ax.set_title(f"{self.cfg.kind} drafter, block {self.cfg.block_size}")
        handles, labels = ax.get_legend_handles_labels()
        accepted = [r for r in self.evals if "heldout_accepted" in r]
        if accepted:
            right = ax.twinx()
            (line,) = right.plot(
                [r["step"] for r in accepted],
                [r["heldout_accepted"] for r in accepted],
                "s-",
                color="tab:green",
                label="held-out tokens / cycle (teacher-forced)",
            )
            right.set_ylabel("tokens per cycle")
            handles.append(line)
            labels.append(line.get_label())
        ax.legend(handles, labels)
        fig.tight_layout()
        fig.savefig(self.out / LOSS_PNG, dpi=100)
        plt.close(fig)


# ------------------------------------------------------------------------- draft vocabulary


def draft_vocabulary(sequences, size: int, vocab_size: int, *, always=()) -> torch.Tensor:
    """The ``size`` ids most frequent among the response tokens of ``sequences`` [(ids,
    prompt_len)] (ties: the smaller id; ``always``, e.g. the EOS ids, are included), sorted:
    a drafter's draft vocabulary (:meth:`BlockDrafter.set_draft_vocab`)."""
    import numpy as np

    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= vocab_size:
        raise ValueError(f"draft vocab size must be an int in [1, {vocab_size}], got {size!r}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, plen in sequences:
        response = np.asarray(ids[plen:], dtype=np.int64)
        counts += np.bincount(response[(response >= 0) & (response < vocab_size)], minlength=vocab_size)
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    counts[forced] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order))


# ------------------------------------------------------------------------- evaluation


@torch.no_grad()
def measure_acceptance(
    target,
    drafters: dict,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 48,
    draft_len: int | None = None,
    k: int = 2,
) -> dict:
    """Mean accepted length (greedy) of dflash and, with a "vp" drafter, d2sd (K = ``k``,
    re-drafting in every cycle: on a CPU its default gate never re-drafts, which would measure
    DFlash again) and the resample control on ``prompts``; also checks the outputs equal ``ar``."""
    from ..decode import ar, d2sd, dflash

    ref, _ = ar.decode(target, prompts, max_new_tokens=max_new_tokens, eos_ids=target.eos_token_ids)
    res = {"prompts": len(prompts), "max_new_tokens": max_new_tokens}
    toks, s = dflash.decode(
        target,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_ids=target.eos_token_ids,
        drafter=drafters["dflash"],
        draft_len=draft_len,
    )
    res["dflash"] = {"mean_accepted": s["mean_accepted"], "equals_ar": toks == ref}
    if "vp" in drafters:
        for mode in ("vp", "resample"):
            toks, s = d2sd.decode(
                target,
                prompts,
                max_new_tokens=max_new_tokens,
                eos_ids=target.eos_token_ids,
                drafter={"dflash": drafters["dflash"], "vp": drafters["vp"]},
                draft_len=draft_len,
                k=k,
                branches=mode,
                redraft_min=0,
            )
            res[f"d2sd_{mode}_k{k}"] = {"mean_accepted": s["mean_accepted"], "equals_ar": toks == ref}
    return res


def model_card(
    trainer: DrafterTrainer, result: dict, acceptance: dict | None, target_name: str, *, command: str | None = None
) -> str:
    from ..cpu import cpu_model, native_bf16

    c, d = trainer.cfg, trainer.drafter.config
    params = sum(p.numel() for p in trainer.drafter.parameters())
    lines = [
        f"# {target_name}-{c.kind}: dspec {'DFlash' if c.kind == 'dflash' else 'D2SD VP'} block drafter",
        "",
        f"- target: `{target_name}` ({trainer.target.config.num_layers} layers, hidden "
        f"{d.hidden_size}, vocab {d.vocab_size}); conditioned on target hidden states {d.target_layer_ids}",
        f"- drafter: {d.num_layers} layer(s), {d.num_heads}/{d.num_kv_heads} heads x {d.head_dim}, "
        f"MLP {d.intermediate_size}; {params:,} parameters (the target's embeddings and output head "
        f"are reused, not stored); block size {d.block_size}",
        f"- data: {dumps(trainer.data_info)}",
        f"- objective: exponentially decayed block cross-entropy, decay {c.decay}"
        + (
            f"; prefix length ~ truncated geometric prior a = {c.prefix_accept}"
            if c.kind == "vp" and c.prefix_mode == "prior"
            else ""
        )
        + (
            "; prefix = the DFlash drafter's accepted drafts before its first rejection, the rejected "
            "draft banned at the first re-drafted slot (blocks without a rejection weigh 0)"
            if c.prefix_mode == "rejection"
            else ""
        ),
        f"- training: {result['step']} steps of {c.batch_size} sequences x {c.anchors_per_seq} blocks, "
        f"AdamW lr {c.lr} -> {c.min_lr}, wall time {result['wall_s'] / 60:.1f} min on "
        f"{trainer.device.type} ({cpu_model() + ', ' if trainer.device.type == 'cpu' else ''}"
        f"{torch.get_num_threads()} threads, autocast {c.autocast}"
        f"{' (native bf16)' if trainer.device.type == 'cpu' and native_bf16() else ''})"
        + (f"; offline target features ({trainer.features.meta['tokens']:,} tokens)" if trainer.features else ""),
        f"- held-out loss: {result['heldout_loss']:.4f} nats (weighted, {len(trainer.heldout)} held-out sequences)",
    ]
    last = trainer.evals[-1] if trainer.evals else {}
    if "heldout_accepted" in last and "rejected_fraction" in last:
        lines.append(
            f"- held-out, teacher-forced, greedy, over the blocks the DFlash drafter's first draft gets "
            f"wrong ({last['rejected_fraction']:.1%} of them): tokens a re-draft at the true rejection "
            f"boundary commits (its accepted slots + the target's token) {last['heldout_accepted']:.3f}; "
            f"top-1 agreement of slots 1..{c.block_size - 1} past the prefix: {last['slot_accuracy']}"
        )
    elif "heldout_accepted" in last:
        lines.append(
            f"- held-out teacher-forced greedy tokens per cycle (accepted drafts + 1): "
            f"{last['heldout_accepted']:.3f}; top-1 agreement of drafted slots 1..{c.block_size - 1}: "
            f"{last['slot_accuracy']}"
        )
    if trainer.drafter.draft_vocab is not None:
        lines.append(
            f"- draft vocabulary: the {trainer.drafter.draft_vocab.numel():,} most frequent response "
            f"tokens of the training sequences (`draft_vocab.safetensors`)"
        )
    if acceptance:
        lines.append(
            f"- acceptance (greedy, held-out prompts, mean tokens committed per target forward): {dumps(acceptance)}"
        )
    made = command or (
        "python -m dspec.train." + ("dflash" if c.kind == "dflash" else "vp_drafter") + f" --target {target_name}"
    )
    lines += ["", f"Made by `{made}`; load with `dspec.models.dflash.load_drafter(path, target)`.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI


def tiny_defaults(cfg: DrafterTrainConfig, target) -> DrafterTrainConfig:
    """Smaller blocks and data for a tiny target on a CPU."""
    if target.config.hidden_size <= 256:
        cfg.block_size = min(cfg.block_size, 8)
        cfg.num_prompts = min(cfg.num_prompts, 1024)
        cfg.response_tokens = min(cfg.response_tokens, 48)
    return cfg


def zlab_mask_token_id(target) -> int:
    """The token a z-lab-format drafter's masked slots embed by default: the target's own
    mask token when it has one, else the last id of its vocabulary."""
    mask_id = getattr(target.config, "mask_token_id", None)
    return int(mask_id) if mask_id is not None else target.config.vocab_size - 1


def main(argv=None, *, kind: str = "dflash", prefix_sampler_factory=None) -> dict:
    name = "dflash" if kind == "dflash" else "vp_drafter"
    ap = argparse.ArgumentParser(
        prog=f"python -m dspec.train.{name}", description=f"Train a {kind} block drafter for an AR target."
    )
    ap.add_argument("--target", required=True, help="shipped target name (tiny-ar, smollm2-135m) or checkpoint dir")
    ap.add_argument("--out", required=True, help="output directory (data, checkpoints, logs, drafter/)")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (fixes the schedule length)")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="16 at scale; 8 by default for tiny targets")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--response-tokens", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help="final learning rate of the cosine schedule (a warm start wants both low: a peak "
        "near a fresh run's knocks the shipped weights back for thousands of steps)",
    )
    ap.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="AdamW weight decay of the matrices (default 0.01; a drafter that memorises its data, "
        "held-out loss flat while the training loss falls, wants more)",
    )
    ap.add_argument(
        "--heldout-start",
        type=int,
        default=0,
        help="hold out only sequences from this index on: a later round on a data directory "
        "resumed to more tokens passes the earlier sequence count (default %(default)s)",
    )
    ap.add_argument(
        "--new-weight",
        type=int,
        default=None,
        help="draw training sequences from --heldout-start on (the directories this round "
        "appends) this many times as often as the earlier ones (default 1)",
    )
    ap.add_argument(
        "--sources", default=None, help="prompt sources and weights, e.g. arithmetic=0.3,stdlib=0.4,sharegpt=0.3"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    ap.add_argument(
        "--data",
        default=None,
        help="training sequences: data-engine directories (python -m dspec.train.data_engine; "
        "several, comma-separated, are read back to back; DIR:N reads its first N shards, "
        "DIR:A-B shards A <= i < B) or "
        "another run's data.pt (default: generate --num-prompts responses here)",
    )
    ap.add_argument(
        "--cache-features",
        action="store_true",
        help="compute the target's hidden states once into OUT/features (offline mode) instead "
        "of one target forward per step",
    )
    ap.add_argument(
        "--autocast",
        choices=("auto", "bf16", "none"),
        default="auto",
        help="bf16 autocast: auto = on CUDA and on CPUs with native bf16 matmul (default %(default)s)",
    )
    ap.add_argument(
        "--dflash-drafter",
        default=None,
        help="(vp) the DFlash drafter (directory or shipped name; default the shipped one) of the "
        "acceptance measurement and of --prefix rejection",
    )
    if kind == "vp":
        ap.add_argument(
            "--prefix",
            choices=("prior", "rejection"),
            default="prior",
            help="where the given prefix ends: drawn from the truncated geometric prior, or where the "
            "DFlash drafter's greedy draft is first rejected (its rejected draft banned at the "
            "first re-drafted slot, as D2SD does) (default %(default)s)",
        )
    ap.add_argument(
        "--init",
        default=None,
        help="warm start from a drafter directory or shipped drafter name of the same shape "
        "(e.g. the shipped DFlash drafter for a VP run, or a previous round), or of the "
        "same shape with fewer layers (--layers deepens it: added layers start as the identity)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="train and draft over this many ids (the most frequent response tokens of the "
        "training sequences, saved as the drafter's draft vocabulary; 0 = the whole vocabulary)",
    )
    ap.add_argument("--ship", default=None, help="also copy the final drafter directory here")
    if kind == "dflash":
        ap.add_argument(
            "--format",
            choices=("dspec", "zlab"),
            default="dspec",
            help="zlab: train a drafter with per-head q / k norm whose masked slots embed the target's "
            "--mask-token-id, saved in z-lab's DFlash format (config.json with "
            "architectures [DFlashDraftModel], dflash_config {target_layer_ids, mask_token_id}; "
            "the checkpoints vLLM / SGLang load with --speculative-algorithm DFLASH)",
        )
        ap.add_argument(
            "--mask-token-id",
            type=int,
            default=None,
            help="(--format zlab) the token masked slots embed (default: the target's mask token, "
            "else the last id of its vocabulary)",
        )
    args = ap.parse_args(argv)
    fmt = getattr(args, "format", "dspec")
    if fmt != "zlab" and getattr(args, "mask_token_id", None) is not None:
        raise SystemExit("--mask-token-id needs --format zlab")
    if fmt == "zlab" and args.draft_vocab:
        raise SystemExit("--format zlab: z-lab's format has no draft vocabulary (drop --draft-vocab)")
    if args.weight_decay is not None and not 0 <= args.weight_decay < float("inf"):
        raise SystemExit(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    import shutil

    out = Path(args.out)
    # the checkpoint to continue is read (and checked) before any work; it never runs code
    resume_state = read_checkpoint(out / CHECKPOINT) if args.resume and (out / CHECKPOINT).is_file() else None
    if args.threads:
        torch.set_num_threads(args.threads)

    from ..hub import load

    target = load(args.target, device=args.device)
    if args.draft_vocab and not 0 < args.draft_vocab <= target.config.vocab_size:
        raise SystemExit(f"--draft-vocab must lie in [1, {target.config.vocab_size}] (0: none), got {args.draft_vocab}")
    zlab = {}
    if fmt == "zlab":
        mask_id = args.mask_token_id if args.mask_token_id is not None else zlab_mask_token_id(target)
        if not 0 <= mask_id < target.config.vocab_size:
            raise SystemExit(f"--mask-token-id must lie in [0, {target.config.vocab_size}), got {mask_id}")
        zlab = {"qk_norm": True, "mask_token_id": mask_id}
    cfg = DrafterTrainConfig(
        kind=kind,
        num_layers=args.layers,
        seed=args.seed,
        autocast=args.autocast,
        prefix_mode=getattr(args, "prefix", "prior"),
        **zlab,
    )
    cfg = tiny_defaults(cfg, target)
    for attr, val in (
        ("block_size", args.block_size),
        ("batch_size", args.batch_size),
        ("num_prompts", args.num_prompts),
        ("response_tokens", args.response_tokens),
        ("lr", args.lr),
        ("min_lr", args.min_lr),
        ("weight_decay", args.weight_decay),
        ("heldout_start", args.heldout_start),
        ("new_weight", args.new_weight),
        ("draft_vocab", args.draft_vocab),
    ):
        if val is not None:
            setattr(cfg, attr, val)
    if args.sources:
        try:
            cfg.sources = parse_source_weights(args.sources)
        except ValueError:
            raise SystemExit(f"--sources must look like arithmetic=0.3,stdlib=0.7, got {args.sources!r}")
    try:
        cfg.__post_init__()
    except ValueError as e:
        raise SystemExit(str(e))
    if (out / CHECKPOINT).exists() and not args.resume:
        raise SystemExit(f"{out / CHECKPOINT} exists: pass --resume to continue or choose another --out")
    sampler = prefix_sampler_factory(cfg) if prefix_sampler_factory else None
    sequences = None
    data_dirs = args.data.split(",") if args.data else []
    from .data_engine import parse_directory

    try:
        missing = [p for p in data_dirs if not parse_directory(p)[0].is_dir()]
    except ValueError as e:
        raise SystemExit(f"--data: {e}")
    if len(data_dirs) > 1 and missing:
        raise SystemExit(f"--data: several sources must all be data-engine directories; not one: {missing}")
    if data_dirs and not missing:
        from .data_engine import read_directories

        try:
            sequences, info = read_directories(data_dirs)
        except ValueError as e:
            raise SystemExit(f"--data: {e}")
    elif args.data and not (out / DATA).is_file():
        blob = load_data(args.data, "--data")
        out.mkdir(parents=True, exist_ok=True)
        torch.save(blob, out / DATA)  # the run's own copy: resume and the card see it
    first_drafter = None
    if cfg.prefix_mode == "rejection":
        from ..models.dflash import resolve_drafter

        try:
            first_drafter = resolve_drafter(args.dflash_drafter, target, "dflash")
        except ValueError as e:
            raise SystemExit(f"--dflash-drafter: {e}")
        sampler = None
    try:
        trainer = DrafterTrainer(
            target,
            cfg,
            out,
            prefix_sampler=sampler,
            sequences=sequences,
            first_drafter=first_drafter,
            features=out / "features" if args.cache_features else None,
        )
    except ValueError as e:
        raise SystemExit(str(e))
    if sequences is not None:
        trainer.data_info = info
    if first_drafter is not None:
        trainer.data_info = dict(
            trainer.data_info, rejections_of=str(args.dflash_drafter or f"{target.shipped_name}-dflash")
        )
    if args.init and resume_state is None:
        try:
            trainer.init_from(args.init)
        except ValueError as e:
            raise SystemExit(f"--init: {e}")
    if resume_state is not None:
        trainer.resume(resume_state)
        del resume_state
    result = trainer.train(minutes=args.minutes, max_steps=args.max_steps)
    target_name = getattr(target, "shipped_name", None) or str(args.target)
    drafter = trainer.drafter.to(dtype=target.dtype).eval()
    drafters = {kind: drafter}
    if kind == "vp":
        from ..models.dflash import resolve_drafter

        try:
            drafters["dflash"] = resolve_drafter(args.dflash_drafter, target, "dflash")
        except ValueError:
            drafters = None
    acceptance = None
    if drafters is not None and "dflash" in drafters:
        held_prompts = [s[:p] for s, p in trainer.heldout[:8]]
        acceptance = measure_acceptance(target, drafters, held_prompts, max_new_tokens=cfg.response_tokens, k=2)
    card = model_card(
        trainer,
        result,
        acceptance,
        target_name,
        command=" ".join(
            [f"python -m dspec.train.{name}"] + list(argv if argv is not None else __import__("sys").argv[1:])
        ),
    )
    path = drafter.save(out / "drafter", card=card, format=fmt)
    result.update(drafter=str(path), acceptance=acceptance)
    if args.ship:
        shutil.copytree(path, args.ship, dirs_exist_ok=True)
        result["shipped"] = args.ship
    print(dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))

"""Block drafters conditioned on an AR target's hidden states: DFlash and D2SD's VP-drafter.

A :class:`BlockDrafter` drafts a block of ``gamma`` slots in one forward: slot 0 holds the
*anchor* (the last committed token, which the target has not run yet), slots ``1 ..
gamma-1`` hold either a learned mask embedding (DFlash: draft them all) or, for D2SD's
variable-prefix drafter (VP-drafter), the first ``i`` of them hold tokens of an earlier
draft and only the rest are masked ("re-draft from a prefix of i drafts").  Slot j predicts
the token at position ``anchor + j``.

Conditioning (DFlash): the target's hidden states at ``target_layer_ids`` of every
committed position (those before the anchor) are concatenated, projected by one linear
layer to the hidden size and normed; every drafter layer projects them with its own k/v
projections into extra *context* keys / values (RoPE at the committed positions) in front
of the block.  Block slots attend to all context positions of their request and to every
slot of their block (bidirectional).  During decoding the context keys / values live in a
:class:`~dspec.models.KVCache` (the drafter-side context cache): each committed position is
projected once, and every drafter forward is one ``dspec.cascade_attention`` per layer over
that prefix plus the block.

The drafter reuses the target's token embedding and output head (frozen, never stored in
the drafter file); it owns the context projection, the mask embedding, 1-2 transformer
layers and a final norm.  A *draft vocabulary* (EAGLE-3's reduced draft vocabulary, a
subset of the target's ids, :meth:`BlockDrafter.set_draft_vocab`) makes the drafting head
read only those rows of the target's head: decoding is unchanged (the target verifies),
drafts just never propose an id outside it.  Files: a directory with ``config.json``,
``model.safetensors`` (or its shards when larger than 15 MB), optionally
``draft_vocab.safetensors``, and a model card ``README.md``; :func:`load_drafter` checks it
fits the target.  It also reads (and :meth:`BlockDrafter.save` with ``format="zlab"``
writes) z-lab's DFlash format (:func:`config_from_zlab`): per-head q / k RMSNorm and a
mask slot embedding the target's ``mask_token_id`` are options of the same drafter.

    >>> drafter = BlockDrafter.for_target(target, num_layers=1, block_size=8)  # doctest: +SKIP
    >>> drafter.save("my-drafter")                                           # doctest: +SKIP
    >>> drafter = load_drafter("my-drafter", target)                         # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .. import _backend, cpu
from ..ops.attention import cascade_attention
from .dense import dense, dense_many
from .kv_cache import KVCache, SuffixKV
from .layers import fused_cpu, head_norm, linear, project, rotate
from .stack import run_layers
from .transformer import MLP, RMSNorm, plan_attention, rope_tables

#: token id meaning "this block slot is masked" in :meth:`BlockDrafter.forward` inputs.
MASK = -1
KINDS = ("dflash", "vp")
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafters"


@dataclass
class DrafterConfig:
    """Shape of a block drafter and what it was built for.

    kind : "dflash" (first drafts: anchor + masks) or "vp" (re-drafts from a prefix).
    hidden_size, vocab_size : the target's (the drafter reads its embeddings / head).
    target_layer_ids : hidden-state indices of the target fed to the context projection
        (``Model.forward(hidden_states=...)`` convention: 0 = embeddings, L = final normed).
    target_num_layers : the target's depth (layer ids are validated against it).
    block_size : gamma, the slots of one drafted block (anchor included) it was trained on.
    num_layers, num_heads, num_kv_heads, head_dim, intermediate_size : the drafter's layers.
    rope_theta, rms_norm_eps : RoPE base and norm epsilon (the target's by default).
    target : the shipped target name (e.g. "tiny-ar") or a free description.
    qk_norm : per-head RMSNorm of the queries and keys (context keys included) before RoPE,
        as z-lab's DFlash drafters have (False: dspec's own drafters).
    mask_token_id : None = masked slots hold the learned ``mask_embedding``; a token id =
        they hold the target's embedding of that token (z-lab's drafters; no mask
        embedding is stored then).
    """

    kind: str
    hidden_size: int
    vocab_size: int
    target_layer_ids: list
    target_num_layers: int
    block_size: int
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target: str | None = None
    extra: dict = field(default_factory=dict)
    qk_norm: bool = False
    mask_token_id: int | None = None

    def validate(self) -> "DrafterConfig":
        from .config import LIMITS, finite

        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r:.80}")
        limits = {
            "hidden_size": LIMITS["hidden_size"],
            "vocab_size": LIMITS["vocab_size"],
            "target_num_layers": LIMITS["num_layers"],
            "block_size": 4096,
            "num_layers": LIMITS["num_layers"],
            "num_heads": LIMITS["num_heads"],
            "num_kv_heads": LIMITS["num_heads"],
            "head_dim": LIMITS["head_dim"],
            "intermediate_size": LIMITS["intermediate_size"],
        }
        for name, hi in limits.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r:.80}")
            if v > hi:
                raise ValueError(f"{name} = {v} is above the largest size dspec accepts ({hi})")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor and at least one draft), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE), got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (finite(v) and v > 0):
                raise ValueError(f"{name} must be a finite positive number, got {v!r:.80}")
        if self.target is not None and not isinstance(self.target, str):
            raise ValueError(f"target must be a str or None, got {self.target!r:.80}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm must be a bool, got {self.qk_norm!r:.80}")
        m = self.mask_token_id
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < self.vocab_size):
            raise ValueError(f"mask_token_id must be None or a token id in [0, {self.vocab_size}), got {m!r:.80}")
        ids = self.target_layer_ids
        if (
            not isinstance(ids, (list, tuple))
            or not ids
            or len(ids) > self.target_num_layers + 1
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= self.target_num_layers for i in ids)
        ):
            raise ValueError(
                f"target_layer_ids must be a non-empty list of ints in [0, {self.target_num_layers}], got {ids!r:.80}"
            )
        self.target_layer_ids = list(ids)
        return self


def default_layer_ids(num_layers: int, count: int = 3) -> list[int]:
    """``count`` target hidden-state indices spread evenly over layers 1 .. L-1 (shallow to
    deep, DFlash's choice), or 1 .. L for a target of fewer layers than ``count``."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    hi = num_layers - 1 if num_layers > count else num_layers
    if hi <= count:
        return list(range(1, hi + 1))
    return sorted({round(1 + k * (hi - 1) / (count - 1)) for k in range(count)})


class DrafterLayer(nn.Module):
    """A pre-norm transformer layer whose keys / values also come from the context."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(
            SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, mlp_bias=False)
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class BlockDrafter(nn.Module):
    """DFlash / VP block drafter (see the module docstring).

    Parameters
    ----------
    config : DrafterConfig.
    target : the target ``dspec.models.Model`` whose embeddings and output head are used
        (held by reference, not a submodule: not trained, not saved).
    """

    def __init__(self, config: DrafterConfig, target=None, *, device=None, dtype=None):
        super().__init__()
        self.config = config.validate()
        c = config
        with torch.device(device or "cpu"):
            self.context_proj = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
            self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            if c.mask_token_id is None:
                self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
            else:
                self.mask_embedding = None  # masked slots embed the target's mask_token_id
            self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if dtype is not None:
            self.to(dtype=dtype)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self._inv_freq_cpu = inv
        self._inv_freq = {}
        self._target = None
        self._draft_ids = None
        self._draft_head = None
        if target is not None:
            self.bind(target)

    # ----------------------------------------------------------------------- building

    @classmethod
    def for_target(
        cls,
        target,
        *,
        kind: str = "dflash",
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids=None,
        num_heads=None,
        num_kv_heads=None,
        head_dim=None,
        intermediate_size=None,
        seed: int | None = 0,
        std: float = 0.02,
        qk_norm: bool = False,
        mask_token_id: int | None = None,
    ) -> "BlockDrafter":
        """A randomly initialised drafter shaped for ``target`` (heads / MLP width default to
        the target's), on the target's device and dtype.  ``qk_norm`` / ``mask_token_id``:
        see :class:`DrafterConfig` (both set: a drafter z-lab's format holds)."""
        tc = target.config
        cfg = DrafterConfig(
            kind=kind,
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            target_layer_ids=list(target_layer_ids)
            if target_layer_ids is not None
            else default_layer_ids(tc.num_layers),
            target_num_layers=tc.num_layers,
            block_size=block_size,
            num_layers=num_layers,
            num_heads=num_heads or tc.num_heads,
            num_kv_heads=num_kv_heads or tc.num_kv_heads,
            head_dim=head_dim or tc.head_dim,
            intermediate_size=intermediate_size or tc.intermediate_size,
            rope_theta=float(tc.rope_theta),
            rms_norm_eps=float(tc.rms_norm_eps),
            target=getattr(target, "shipped_name", None)
            or getattr(target, "name_or_path", None)
            and str(target.name_or_path),
            extra={"target_fingerprint": target_fingerprint(target)},
            qk_norm=qk_norm,
            mask_token_id=mask_token_id,
        )
        drafter = cls(cfg, device=target.device)
        drafter.init_random_(std=std, seed=seed)
        drafter.to(dtype=target.dtype)
        drafter.bind(target)
        return drafter

    @torch.no_grad()
    def init_random_(self, std: float = 0.02, *, seed: int | None = None) -> "BlockDrafter":
        """Normal(0, std) matrices, unit norms; the mask embedding ~ Normal(0, std)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def bind(self, target) -> "BlockDrafter":
        """Attach ``target`` (its embeddings / head are used); ValueError when it does not fit."""
        check_compatible(self.config, target)
        object.__setattr__(self, "_target", target)  # a reference, not a submodule
        return self

    @property
    def target(self):
        if self._target is None:
            raise ValueError("this drafter is not bound to a target: call drafter.bind(target)")
        return self._target

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The draft vocabulary (int64 [V'] target ids), None for the full vocabulary."""
        return self._draft_ids

    def set_draft_vocab(self, ids) -> "BlockDrafter":
        """Draft only token ids ``ids`` (distinct ids in [0, vocab_size), any order; None =
        the whole vocabulary).  :meth:`forward` with ``draft_vocab=True`` then returns logits
        over them, column j for token ``ids[j]``."""
        if ids is None:
            self._draft_ids, self._draft_head = None, None
            return self
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"draft vocab must be a non-empty 1-D tensor of token ids, got {ids.dtype} {list(ids.shape)}"
            )
        ids = ids.to(torch.int64)
        v = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"draft vocab ids must lie in [0, {v}), got [{int(ids.min())}, {int(ids.max())}]")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("draft vocab ids must be distinct")
        self._draft_ids, self._draft_head = ids.to(self.device), None
        return self

    def _head_weight(self, draft_vocab: bool) -> torch.Tensor:
        """The target's output head, or its draft-vocabulary rows (gathered once, again when
        the target's head changes)."""
        w = self.target.output_weight
        if not draft_vocab or self._draft_ids is None:
            return w
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._draft_head is None or self._draft_head[0] != key:
            ids = self._draft_ids.to(w.device)
            self._draft_head = (key, w.detach().index_select(0, ids).contiguous())
        return self._draft_head[1]

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"kind={c.kind}, layers={c.num_layers}, hidden={c.hidden_size}, heads={c.num_heads}/"
            f"{c.num_kv_heads}x{c.head_dim}, block_size={c.block_size}, "
            f"target_layer_ids={c.target_layer_ids}, target={c.target!r}"
        )

    # ----------------------------------------------------------------------- pieces

    def _rope(self, positions: torch.Tensor):
        key = str(positions.device)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq_cpu.to(positions.device)
        return rope_tables(positions, self._inv_freq[key])

    def target_features(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """The target's hidden states (``Output.hidden``, in ``target_layer_ids`` order,
        each [B, N, H]) -> projected, normed context features [B, N, H]."""
        if len(hidden) != len(self.config.target_layer_ids):
            raise ValueError(
                f"hidden must hold {len(self.config.target_layer_ids)} tensors (one per "
                f"target layer id), got {len(hidden)}"
            )
        x = torch.cat([h.to(self.dtype) for h in hidden], dim=-1)
        return self.context_norm(linear(self.context_proj, x))

    def _context_kv(self, layer: DrafterLayer, features: torch.Tensor, cos, sin):
        b, t, _ = features.shape
        c = self.config
        k, v = project((layer.k_proj, layer.v_proj), features)
        k = head_norm(layer.k_norm, k.view(b, t, c.num_kv_heads, c.head_dim))
        v = v.view(b, t, c.num_kv_heads, c.head_dim)
        return rotate(k, cos, sin), v

    def context_kv(self, hidden: list[torch.Tensor], positions: torch.Tensor) -> SuffixKV:
        """Per-layer context keys (RoPE at ``positions`` [B, N]) and values of target hidden
        states [B, N, H] each, for ``KVCache.append`` into :meth:`new_cache`."""
        features = self.target_features(hidden)
        cos, sin = self._rope(positions)
        fused = self._context_kv_fused(features, cos, sin)
        if fused is not None:
            return fused
        c = self.config
        b, t, _ = features.shape
        # every layer's two projections in one grouped call and one RoPE over all the keys
        # (a decode cycle commits a few rows: the per-layer calls were ~0.3 ms of op
        # dispatch); bit-identical to _context_kv per layer, which training differentiates
        kv = torch.stack(project([m for layer in self.layers for m in (layer.k_proj, layer.v_proj)], features))
        kv = kv.view(c.num_layers, 2, b, t, c.num_kv_heads, c.head_dim)
        keys = kv[:, 0]
        if c.qk_norm:
            keys = torch.stack([layer.k_norm(keys[i]) for i, layer in enumerate(self.layers)])
        keys = rotate(keys, cos, sin)
        return SuffixKV(stacked=torch.stack([keys, kv[:, 1]]))

    def _context_kv_fused(self, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> SuffixKV | None:
        """:meth:`context_kv`'s projections and RoPE as three dspec._C calls on the CPU
        (None elsewhere, or under autograd): every layer's keys from one weight (the layers'
        k_proj rows stacked, kept with the drafter), its values from another, the keys
        rotated in place as one [rows, layers x kv heads, D] tensor.  A decode cycle runs
        this after each verification, right after the target's forward has streamed its
        weights through the caches, where each small torch op costs ~10-60 us cold: the
        per-op version's ~15 ops were ~0.3 ms of a ~20 ms SmolLM2 cycle.  The same column
        dot products and the same float32 RoPE arithmetic: bit-identical (tested)."""
        layers = [m for layer in self.layers for m in (layer.k_proj, layer.v_proj)]
        if (
            self.config.qk_norm
            or not all(type(m) is nn.Linear for m in layers)
            or not fused_cpu(features, cos, sin)
            or any(m.weight.requires_grad and torch.is_grad_enabled() for m in layers)
            or cos.dtype != torch.float32
        ):
            return None
        c = self.config
        b, t, _ = features.shape
        key_w, key_b, value_w, value_b = self._stacked_context_weights()
        keys, values = dense_many(features.contiguous(), [key_w, value_w], [key_b, value_b])
        heads = c.num_layers * c.num_kv_heads
        _backend.extension().rope(
            keys.data_ptr(),
            0,
            cos.contiguous().data_ptr(),
            sin.contiguous().data_ptr(),
            _backend.FLOAT_CODE[keys.dtype],
            b * t,
            heads,
            0,
            c.head_dim,
            cpu.kernel_threads(),
        )
        shape = (b, t, c.num_layers, c.num_kv_heads, c.head_dim)
        return SuffixKV(
            stacked=torch.stack([keys.view(shape).permute(2, 0, 1, 3, 4), values.view(shape).permute(2, 0, 1, 3, 4)])
        )

    def _stacked_context_weights(self):
        """Every layer's k_proj (and v_proj) weight rows stacked, [L * Hkv * D, H], biases
        likewise (None without); rebuilt when a weight changes (its pointer or version)."""
        mods = [(layer.k_proj, layer.v_proj) for layer in self.layers]
        key = tuple((m.weight.data_ptr(), m.weight._version) for pair in mods for m in pair)
        kept = self.__dict__.get("_context_weights")
        if kept is None or kept[0] != key:
            stacked = []
            for j in (0, 1):
                ms = [pair[j] for pair in mods]
                bias = None if ms[0].bias is None else torch.cat([m.bias.detach() for m in ms])
                stacked += [torch.cat([m.weight.detach() for m in ms]), bias]
            kept = (key, tuple(stacked))
            self.__dict__["_context_weights"] = kept
        return kept[1]

    def new_cache(self, batch_size: int, *, capacity: int = 0) -> KVCache:
        """An empty drafter-side context cache (projected target features as K/V per layer)."""
        c = self.config
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
            capacity=capacity,
        )

    def embed_block(self, tokens: torch.Tensor) -> torch.Tensor:
        """Block ids [B, N] (``MASK`` = -1 for a masked slot) -> input embeddings [B, N, H]."""
        target = self.target
        masked = tokens < 0
        mask_id = self.config.mask_token_id
        x = target.embed_tokens(tokens.clamp_min(0) if mask_id is None else tokens.masked_fill(masked, mask_id))
        x = x.to(self.dtype)
        scale = target.config.embed_scale
        if scale != 1.0:
            x = x * scale
        if mask_id is not None:
            return x
        return torch.where(masked[..., None], self.mask_embedding.to(x.dtype), x)

    def head(self, x: torch.Tensor, *, draft_vocab: bool = False) -> torch.Tensor:
        """Final norm + the target's output head -> logits [..., V] (``draft_vocab``: over
        :attr:`draft_vocab` [..., V'] when the drafter has one)."""
        w = self._head_weight(draft_vocab)
        logits = dense(self.norm(x).to(w.dtype).contiguous(), w)
        scale = self.target.config.logit_scale
        return logits * scale if scale != 1.0 else logits

    # ----------------------------------------------------------------------- forwards

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        mask=None,
        backend: str | None = None,
        logits_from: int = 0,
        draft_vocab: bool = False,
    ) -> torch.Tensor:
        """Draft blocks after each request's cached context (decoding path).

        Parameters
        ----------
        tokens : int [B, N], the block slots (``MASK`` = -1 where the drafter must fill
            in); N may hold several blocks side by side when ``mask`` separates them.
        positions : int [B, N], absolute positions (the anchor of a block sits at the
            context length).
        cache : the drafter context cache (:meth:`new_cache`), B requests.
        mask : packed suffix words [N, W] / [B, N, W] (``dspec.masks``), None =
            bidirectional over all N slots (one block).
        logits_from : the first slot whose logits are computed (1 skips a lone block's
            anchor: the head is the largest matrix the drafter reads).
        draft_vocab : logits over :attr:`draft_vocab` (when the drafter has one).

        Returns
        -------
        logits [B, N - logits_from, V] (or V'): row j is the drafter's distribution of the
        token *at* slot ``logits_from + j``'s position (slot 0, the anchor's, is not a
        prediction).
        """
        if tokens.dim() != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must both be [B, N], got {list(tokens.shape)} and {list(positions.shape)}"
            )
        if not isinstance(cache, KVCache) or cache.batch_size != tokens.shape[0]:
            raise ValueError("cache must be this drafter's KVCache (new_cache) with one row per request")
        if isinstance(logits_from, bool) or not isinstance(logits_from, int) or not 0 <= logits_from < tokens.shape[1]:
            raise ValueError(f"logits_from must be an int in [0, {tokens.shape[1]}), got {logits_from!r}")
        c = self.config
        b, n = tokens.shape
        x = self.embed_block(tokens)
        cos, sin = self._rope(positions)
        fused = self._layers_fused(x, cos, sin, mask, cache, backend)
        if fused is not None:
            x = fused
        for i, layer in enumerate(self.layers if fused is None else ()):
            h = layer.input_layernorm(x)
            q, k, v = project((layer.q_proj, layer.k_proj, layer.v_proj), h)
            q = rotate(head_norm(layer.q_norm, q.view(b, n, c.num_heads, c.head_dim)), cos, sin)
            k = rotate(head_norm(layer.k_norm, k.view(b, n, c.num_kv_heads, c.head_dim)), cos, sin)
            v = v.view(b, n, c.num_kv_heads, c.head_dim)
            o = cascade_attention(q, k, v, mask, backend=backend, **cache.prefix(i))
            x = x + linear(layer.o_proj, o.reshape(b, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(x[:, logits_from:] if logits_from else x, draft_vocab=draft_vocab)

    def _layers_fused(self, x, cos, sin, mask, cache: KVCache, backend):
        """Every drafter layer in one ``dspec._C.decoder_layers`` call (``stack.run_layers``,
        the target's one-call path: the same kernels, so the same bits as the per-op loop),
        the context read in place as the cache's pages; None where the per-op loop must run
        (autograd, another device or backend).  A drafting step's ~30 small kernel calls from
        Python cost about as much as their arithmetic."""
        if not fused_cpu(x, self.norm.weight, cos, sin):
            return None
        b, n = x.shape[:2]
        plan, prefix = plan_attention(self.config, self.dtype, self.device, b, n, mask, cache, backend)
        if plan.backend != "cpp":
            return None
        out = run_layers(self, x.contiguous(), cos.contiguous(), sin.contiguous(), plan, prefix, (), False)
        return None if out is None else out[0]

    def forward_train(
        self,
        context_hidden: list[torch.Tensor],
        blocks: torch.Tensor,
        starts: torch.Tensor,
        *,
        context_length: torch.Tensor | None = None,
        draft_vocab: bool = False,
    ) -> torch.Tensor:
        """Many blocks per sequence against the full context, differentiable (training path).

        Parameters
        ----------
        context_hidden : the target's hidden states of whole sequences, ``target_layer_ids``
            order, each [B, T, H] (position t = row t).
        blocks : int [B, M, G], M blocks of G slots per sequence (``MASK`` = -1 masked).
        starts : int [B, M], the anchor position of each block: block m sees context rows
            t < starts[b, m] (and t < context_length[b]) and its own G slots.
        context_length : int [B] valid rows per sequence (default T).
        draft_vocab : logits over :attr:`draft_vocab` (when the drafter has one).

        Returns
        -------
        logits [B, M, G, V] (or V'; the same function as :meth:`forward` on the same inputs).
        """
        c = self.config
        bsz, m, g = blocks.shape
        t = context_hidden[0].shape[1]
        features = self.target_features(context_hidden)  # [B, T, H]
        ctx_pos = torch.arange(t, device=features.device).expand(bsz, t)
        cos_c, sin_c = self._rope(ctx_pos)
        pos = (starts[..., None] + torch.arange(g, device=blocks.device)).reshape(bsz, m * g)
        cos_b, sin_b = self._rope(pos)
        # visibility [B, M*G, T + M*G]: context before the anchor, own block bidirectional
        block_of = torch.arange(m * g, device=blocks.device) // g
        limit = starts if context_length is None else torch.minimum(starts, context_length[:, None])
        see_ctx = torch.arange(t, device=blocks.device)[None, None, :] < limit.repeat_interleave(g, 1)[..., None]
        see_blk = (block_of[:, None] == block_of[None, :]).expand(bsz, -1, -1)
        allowed = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [B, 1, Q, K]
        x = self.embed_block(blocks.reshape(bsz, m * g))
        rep = c.num_heads // c.num_kv_heads
        for layer in self.layers:
            kc, vc = self._context_kv(layer, features, cos_c, sin_c)
            h = layer.input_layernorm(x)
            q = rotate(head_norm(layer.q_norm, layer.q_proj(h).view(bsz, m * g, c.num_heads, c.head_dim)), cos_b, sin_b)
            kb = rotate(
                head_norm(layer.k_norm, layer.k_proj(h).view(bsz, m * g, c.num_kv_heads, c.head_dim)), cos_b, sin_b
            )
            vb = layer.v_proj(h).view(bsz, m * g, c.num_kv_heads, c.head_dim)
            k = torch.cat([kc, kb], 1).repeat_interleave(rep, 2)
            v = torch.cat([vc, vb], 1).repeat_interleave(rep, 2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed
            )
            x = x + layer.o_proj(o.transpose(1, 2).reshape(bsz, m * g, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(x, draft_vocab=draft_vocab).view(bsz, m, g, -1)

    # ----------------------------------------------------------------------- files

    def save(self, path: str | os.PathLike, *, card: str | None = None, format: str = "dspec") -> Path:
        """Write ``config.json``, ``model.safetensors`` (drafter weights only; above 15 MB as
        shards ``model-XXXXX-of-NNNNN.safetensors``, so that every shipped file stays under
        16 MB) and a model card ``README.md`` (``card``, or a generated one) into ``path``.

        ``format="zlab"`` writes z-lab's DFlash format instead (:func:`config_to_zlab`'s
        config, z-lab's weight names: what vLLM / SGLang load with ``--speculative-algorithm
        DFLASH``); ValueError for a drafter that format cannot hold (see
        :func:`config_to_zlab`; a draft vocabulary neither)."""
        from safetensors.torch import save_file

        if format not in ("dspec", "zlab"):
            raise ValueError(f"format must be 'dspec' or 'zlab', got {format!r:.80}")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if format == "zlab":
            config = config_to_zlab(self.config)
            if self._draft_ids is not None:
                raise ValueError(
                    "z-lab's format has no draft vocabulary: set_draft_vocab(None) or save in format='dspec'"
                )
            state = {weight_name_to_zlab(k): v for k, v in state.items()}
        else:
            config = asdict(self.config)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for old in out.glob("model*.safetensors"):
            old.unlink()
        shards = _shard(state, MAX_FILE_BYTES)
        meta = {"format": "pt", "dspec": "block_drafter"}
        if len(shards) == 1:
            save_file(state, str(out / "model.safetensors"), metadata=meta)
        for i, part in enumerate(shards if len(shards) > 1 else []):
            save_file(part, str(out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), metadata=meta)
        vocab_file = out / DRAFT_VOCAB_FILE
        if self._draft_ids is not None:
            save_file({"ids": self._draft_ids.to(torch.int32).cpu().contiguous()}, str(vocab_file), metadata=meta)
        elif vocab_file.exists():
            vocab_file.unlink()
        if card is None and not (out / "README.md").exists():
            c = self.config
            card = (
                f"# dspec {c.kind} block drafter\n\nTarget: {c.target}; layers {c.num_layers}; block size "
                f"{c.block_size}; target hidden states {c.target_layer_ids}.\n"
            )
        if card is not None:
            (out / "README.md").write_text(card)
        return out


MAX_FILE_BYTES = 15_000_000  # shipped files stay under 16 MB: larger drafters are saved in shards


def _shard(state: dict, limit: int) -> list[dict]:
    """Split a state dict into consecutive groups of at most ``limit`` bytes (a tensor larger
    than the limit gets a group of its own)."""
    shards, cur, size = [], {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += n
    return shards + [cur] if cur or not shards else shards


def _weight_files(path: Path) -> list[Path]:
    """``model.safetensors``, or the shards ``model-XXXXX-of-NNNNN.safetensors`` when all present
    (regular files only: ValueError for a FIFO, device or directory of such a name)."""
    from ._files import is_regular_file

    if is_regular_file(path / "model.safetensors"):
        return [path / "model.safetensors"]
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if not shards:
        return []
    total = shards[0].name.rsplit("-of-", 1)[1].split(".")[0]
    if not total.isdigit() or len(shards) != int(total):
        raise ValueError(f"drafter directory {path} has {len(shards)} of {total!r} weight shards")
    for f in shards:
        is_regular_file(f)
    return shards


def target_fingerprint(target) -> str:
    """A short hash of the target's output head (first 64 rows): drafters record it so that
    loading one for a retrained target of the same shape warns instead of failing silently.
    The rows are rounded to bf16 first, so a target loaded in fp32 or bf16 hashes the same."""
    import hashlib

    rows = target.output_weight.detach()[:64].to(torch.bfloat16).float().cpu().contiguous()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


def check_compatible(config: DrafterConfig, target) -> None:
    """ValueError unless ``target`` has the drafter's hidden size, vocabulary and layers."""
    tc = getattr(target, "config", None)
    if tc is None or not hasattr(target, "embed_tokens"):
        raise ValueError(f"target must be a dspec.models.Model, got {type(target).__name__}")
    if getattr(tc, "attention", "causal") != "causal":
        raise ValueError(f"block drafters serve causal (AR) targets; the target attends {tc.attention!r}")
    if tc.hidden_size != config.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} does not match the target's {tc.hidden_size}")
    if tc.vocab_size != config.vocab_size:
        raise ValueError(f"drafter vocab_size {config.vocab_size} does not match the target's {tc.vocab_size}")
    if tc.num_layers != config.target_num_layers:
        raise ValueError(
            f"drafter was built for a {config.target_num_layers}-layer target, this target has {tc.num_layers} layers"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i <= tc.num_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} do not exist in a {tc.num_layers}-layer target")


def shipped_drafter_path(target_name: str, kind: str) -> Path:
    """Where dspec ships the ``kind`` drafter of shipped target ``target_name``."""
    return ASSETS / f"{target_name}-{kind}"


def load_drafter(path_or_name, target, *, kind: str | None = None, device=None, dtype=None) -> BlockDrafter:
    """Load a drafter directory (or a shipped drafter name such as ``"tiny-ar-dflash"``) and
    bind it to ``target``.

    Raises ValueError when ``path_or_name`` is not a BlockDrafter, a path or a name (a dspec
    model included: models draft in ``diffuspec``, not as block drafters), when the
    directory is missing or incomplete, when ``kind`` is given and differs from the file's,
    or when the drafter does not fit the target (hidden size, vocabulary, target depth /
    layer ids) or its weights (sizes checked against the safetensors headers before any
    tensor is built).  Weights go to the target's device and dtype unless ``device`` /
    ``dtype`` say otherwise.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ._files import is_regular_file, read_json

    if isinstance(path_or_name, BlockDrafter):
        drafter = path_or_name
        if kind is not None and drafter.config.kind != kind:
            raise ValueError(f"drafter is a {drafter.config.kind!r} drafter, expected {kind!r}")
        if any(t.is_meta for t in drafter.parameters()):
            raise ValueError(
                "drafter: its weights are on the meta device (no data): load or build it on 'cpu' or 'cuda'"
            )
        return drafter.bind(target)
    names = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
    if isinstance(path_or_name, (bytes, bytearray)) or not isinstance(path_or_name, (str, os.PathLike)):
        hint = ""
        if hasattr(path_or_name, "config") and hasattr(path_or_name, "plan"):
            hint = (
                " (a dspec model is not a block drafter: block-diffusion models draft for an AR target in "
                "method 'diffuspec')"
            )
        raise ValueError(
            f"drafter must be a BlockDrafter, a drafter directory or a shipped drafter name "
            f"({names}), got {type(path_or_name).__name__}{hint}"
        )
    if not os.fspath(path_or_name):
        raise ValueError(f"drafter must name a drafter directory or a shipped drafter ({names}), got ''")
    path = Path(os.fspath(path_or_name)).expanduser()
    if not path.is_dir():
        shipped = ASSETS / os.fspath(path_or_name)
        if os.fspath(path_or_name) in names:
            path = shipped
        else:
            raise ValueError(
                f"drafter {os.fspath(path_or_name)!r} is neither a directory nor a shipped drafter ({names})"
            )
    weight_files = _weight_files(path)
    raw = read_json(
        path / "config.json", required=True, missing=f"drafter directory {path} has no config.json", want=dict
    )
    if not weight_files:
        raise ValueError(f"drafter directory {path} has no model.safetensors")
    zlab = is_zlab_config(raw)
    if zlab:
        cfg = config_from_zlab(raw, str(path / "config.json"))
    else:
        try:
            cfg = DrafterConfig(**raw)
        except TypeError as e:
            raise ValueError(f"{path / 'config.json'} is not a drafter config: {e}") from None
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(f"{path / 'config.json'}: {e}") from None
    if kind is not None and cfg.kind != kind:
        raise ValueError(f"{path} holds a {cfg.kind!r} drafter, expected {kind!r}")
    check_compatible(cfg, target)
    # names and shapes from the headers (no data) before the drafter's modules are built
    got = {}
    for f in weight_files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                got.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
        except Exception as e:  # noqa: BLE001  (safetensors raises SafetensorError / OSError)
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
    rename = {}
    if zlab:  # z-lab's names -> dspec's (an unknown name is marked: reported below)
        rename = {k: weight_name_from_zlab(k) or f"?{k}" for k in got}
        got = {rename[k]: v for k, v in got.items()}
    layers = {k.split(".", 2)[1] for k in got if k.startswith("layers.") and k.count(".") >= 2}
    if cfg.num_layers > len(layers):
        raise ValueError(
            f"{path / 'config.json'}: num_layers = {cfg.num_layers}, but the weights hold {len(layers)} layers"
        )
    recorded = cfg.extra.get("target_fingerprint")
    if recorded and recorded != target_fingerprint(target):
        import warnings

        warnings.warn(
            f"drafter {path} was trained for a target with other weights (fingerprint {recorded}, this "
            f"target {target_fingerprint(target)}): it fits the shapes but may draft poorly; retrain it",
            stacklevel=2,
        )
    drafter = BlockDrafter(cfg, device="meta")
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        back = {v: k for k, v in rename.items()}
        named = (lambda k: back.get(k, weight_name_to_zlab(k))) if zlab else (lambda k: k)  # as the file names them
        missing, extra = [named(k) for k in missing], [named(k) for k in extra]
        wrong = [f"{named(k)} {list(got[k])} (expected {list(expected[k])})" for k in wrong]
        raise ValueError(
            f"{path / 'model.safetensors'} does not match its config: missing {missing[:4]}, "
            f"unexpected {extra[:4]}, wrong shapes {wrong[:4]}"
        )
    state = {}
    for f in weight_files:
        state.update(load_file(str(f)))
    if rename:
        state = {rename[k]: v for k, v in state.items()}
    drafter = drafter.to_empty(device=device or target.device)
    drafter.load_state_dict(state)
    drafter.to(dtype=dtype or target.dtype)
    drafter._inv_freq = {}
    drafter.eval()
    drafter.bind(target)
    if is_regular_file(path / DRAFT_VOCAB_FILE):
        ids = load_file(str(path / DRAFT_VOCAB_FILE)).get("ids")
        if ids is None:
            raise ValueError(f"{path / DRAFT_VOCAB_FILE} holds no 'ids' tensor")
        drafter.set_draft_vocab(ids)
    return drafter


# --------------------------------------------------------------------------- z-lab's format

#: ``architectures`` entry of z-lab's DFlash drafters (the checkpoints vLLM, SGLang and
#: llama.cpp load with ``--speculative-algorithm DFLASH``)
ZLAB_ARCHITECTURE = "DFlashDraftModel"
_ZLAB_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "block_size",
    "num_target_layers",
    "dflash_config",
)
_ZLAB_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_ZLAB_TOP = {
    "fc.weight": "context_proj.weight",
    "hidden_norm.weight": "context_norm.weight",
    "norm.weight": "norm.weight",
}


def is_zlab_config(raw: dict) -> bool:
    """Whether a drafter ``config.json`` is in z-lab's DFlash format (a Qwen3 config plus
    ``block_size``, ``num_target_layers`` and ``dflash_config``)."""
    arch = raw.get("architectures")
    return "dflash_config" in raw or (isinstance(arch, list) and ZLAB_ARCHITECTURE in arch)


def zlab_default_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """z-lab's layer choice when ``dflash_config`` names none, in z-lab's convention (0 =
    the output of the target's first decoder layer): the middle layer for a one-layer
    drafter, else ``num_layers`` ids spread evenly over 1 .. num_target_layers - 3."""
    if num_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_layers - 1)) for i in range(num_layers)]


def config_from_zlab(raw: dict, where: str = "config.json") -> DrafterConfig:
    """A z-lab DFlash ``config.json`` -> the :class:`DrafterConfig` of the same drafter.

    Translations: z-lab's ``target_layer_ids`` count decoder-layer outputs from 0 (id i
    reads transformers' ``hidden_states[i + 1]``); dspec's count ``hidden_states`` indices
    (0 = embeddings, L = final normed), so dspec's id is z-lab's plus one.  Masked slots
    embed the target's ``mask_token_id``; every layer has per-head q / k RMSNorm.
    ValueError for a missing key, a value of the wrong kind, or an option dspec's drafter
    does not compute (attention biases, sliding windows, scaled RoPE, another activation).
    """
    missing = [k for k in _ZLAB_REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{where}: a z-lab DFlash drafter config needs {missing}")
    dc = raw["dflash_config"]
    if not isinstance(dc, dict):
        raise ValueError(f"{where}: dflash_config must be an object, got {type(dc).__name__}")
    if "mask_token_id" not in dc or dc["mask_token_id"] is None:
        raise ValueError(f"{where}: dflash_config needs mask_token_id (the token masked slots embed)")

    def whole(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r:.80}")
        return value

    sizes = {k: whole(k, raw[k]) for k in _ZLAB_REQUIRED[:-1]}
    heads = sizes["num_attention_heads"]
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if sizes["hidden_size"] % heads:
            raise ValueError(f"{where}: no head_dim, and hidden_size is not a multiple of num_attention_heads")
        head_dim = sizes["hidden_size"] // heads
    whole("head_dim", head_dim)
    if raw.get("attention_bias", False) is not False:
        raise ValueError(
            f"{where}: attention_bias = {raw['attention_bias']!r}: dspec's drafter layers have no attention biases"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act = {raw['hidden_act']!r}: dspec's drafter MLP is SiLU-gated")
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(f"{where}: sliding-window layers are not supported in a DFlash drafter")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise ValueError(f"{where}: rope_parameters / rope_scaling must be objects")
    for table in (rope, scaling):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: RoPE type {kind!r}: dspec's drafter takes default RoPE only")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    eps = raw.get("rms_norm_eps", 1e-6)
    ids = dc.get("target_layer_ids")
    if ids is None:
        ids = zlab_default_layer_ids(sizes["num_target_layers"], sizes["num_hidden_layers"])
    n = sizes["num_target_layers"]
    if (
        not isinstance(ids, list)
        or not ids
        or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ids)
    ):
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids must be a non-empty list of decoder-layer "
            f"ids in [0, {n}) (num_target_layers = {n}), got {ids!r:.80}"
        )
    cfg = DrafterConfig(
        kind="dflash",
        hidden_size=sizes["hidden_size"],
        vocab_size=sizes["vocab_size"],
        target_layer_ids=[i + 1 for i in ids],
        target_num_layers=n,
        block_size=sizes["block_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=sizes["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=sizes["intermediate_size"],
        rope_theta=theta,
        rms_norm_eps=eps,
        target=raw.get("_name_or_path") if isinstance(raw.get("_name_or_path"), str) else None,
        extra={"format": "zlab"},
        qk_norm=True,
        mask_token_id=dc["mask_token_id"],
    )
    try:
        return cfg.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def config_to_zlab(cfg: DrafterConfig) -> dict:
    """The z-lab DFlash ``config.json`` of a drafter that z-lab's format can express (a
    "dflash" drafter with q / k norm, a ``mask_token_id`` and target layer ids >= 1)."""
    if cfg.kind != "dflash" or not cfg.qk_norm or cfg.mask_token_id is None or min(cfg.target_layer_ids) < 1:
        raise ValueError(
            "z-lab's format holds 'dflash' drafters with qk_norm=True, a mask_token_id and "
            f"target_layer_ids >= 1; this one is kind={cfg.kind!r}, qk_norm={cfg.qk_norm}, "
            f"mask_token_id={cfg.mask_token_id}, target_layer_ids={cfg.target_layer_ids}"
        )
    return {
        "architectures": [ZLAB_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
            "mask_token_id": cfg.mask_token_id,
        },
    }


def weight_name_from_zlab(name: str) -> str | None:
    """A z-lab drafter weight name -> dspec's (None for a name z-lab's drafter has not)."""
    if name in _ZLAB_TOP:
        return _ZLAB_TOP[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[1].isdigit() and parts[4] == "weight":
        if parts[2] == "self_attn" and parts[3] in _ZLAB_ATTENTION:
            return f"layers.{parts[1]}.{parts[3]}.weight"
        if parts[2] == "mlp" and parts[3] in ("gate_proj", "up_proj", "down_proj"):
            return name
    if (
        len(parts) == 4
        and parts[0] == "layers"
        and parts[1].isdigit()
        and parts[3] == "weight"
        and parts[2] in ("input_layernorm", "post_attention_layernorm")
    ):
        return name
    return None


def weight_name_to_zlab(name: str) -> str:
    """dspec's drafter weight name -> z-lab's (the inverse of :func:`weight_name_from_zlab`)."""
    for theirs, ours in _ZLAB_TOP.items():
        if name == ours:
            return theirs
    parts = name.split(".")
    if len(parts) == 4 and parts[2] in _ZLAB_ATTENTION:
        return f"layers.{parts[1]}.self_attn.{parts[2]}.weight"
    return name


def resolve_drafter(drafter, target, kind: str) -> BlockDrafter:
    """``drafter`` as given to a decode method: a BlockDrafter, a path / shipped name, or
    None for the drafter dspec ships for ``target`` (looked up by ``target.shipped_name``)."""
    if drafter is not None:
        return load_drafter(drafter, target, kind=kind)
    name = getattr(target, "shipped_name", None)
    if name is None:
        raise ValueError(
            f"drafter=None needs a shipped target (dspec.load('tiny-ar'), ...); this target "
            f"is a checkpoint directory: pass drafter= a {kind!r} drafter directory or a "
            f"BlockDrafter (train one with `python -m dspec.train."
            f"{'dflash' if kind == 'dflash' else 'vp_drafter'}`)"
        )
    path = shipped_drafter_path(name, kind)
    if not path.is_dir():
        raise ValueError(
            f"dspec ships no {kind!r} drafter for target {name!r}; pass drafter= a "
            f"drafter directory (python -m dspec.train.{'dflash' if kind == 'dflash' else 'vp_drafter'} "
            f"--target {name} --out DIR)"
        )
    # kept on the target (not in a module-level dict, which would keep every target alive):
    # loading costs 6-15 ms, paid once per target rather than on every generate call
    cache = target.__dict__.setdefault("_dspec_shipped_drafters", {})
    key = (kind, str(target.device), target.dtype)
    if key not in cache:
        cache[key] = load_drafter(path, target, kind=kind)
    return cache[key]


def block_loss_weights(block_size: int, prefix_length, decay: float, *, device=None) -> torch.Tensor:
    """Exponentially decayed cross-entropy weights of a block's slots.

    Slot j (1 <= j < G) of a block whose first ``i = prefix_length`` drafts are given
    gets weight ``exp(-(j - i - 1) / decay)`` when j > i (distance from the last given
    token: the first re-drafted slot weighs 1) and 0 otherwise (slot 0 = the anchor and
    the given prefix are not predicted).  ``prefix_length`` int or int tensor [...] ->
    weights [..., G] float32.  DFlash's first-draft loss is the case i = 0.
    """
    if not (isinstance(decay, (int, float)) and decay > 0 and math.isfinite(decay)):
        raise ValueError(f"decay must be a positive finite number, got {decay!r}")
    i = torch.as_tensor(prefix_length, device=device)
    j = torch.arange(block_size, device=i.device)
    dist = (j - i[..., None] - 1).to(torch.float32)
    return torch.where(dist >= 0, torch.exp(-dist / decay), torch.zeros_like(dist))

"""Mask-selective adapters: a block-diffusion model that *is* its causal base wherever no
[MASK] token is.

Adapting an AR model to block diffusion with a LoRA on every token changes the model
everywhere, so its block-size-1 mode is no longer the AR model and self-speculation cannot
verify against the real target.  A mask-selective adapter keeps the base exact:

- **only [MASK] rows are adapted**: each adapted projection computes ``x W^T (+ b)`` for
  every row and adds ``scale * (x A^T) B^T`` at the rows whose input token is [MASK] (the
  row index is found once per forward and shared by every layer); the [MASK] input
  embedding is a trained input-only row, so the tied output head is untouched;
- **clean tokens attend causally** (``ModelConfig.clean_causal``): a query whose token is
  not [MASK] sees only keys at positions <= its own, whatever block structure the plan
  asks for; [MASK] queries keep the plan's visibility (their block bidirectionally, the
  committed prefix).  The rule only removes visibility, so causal and tree plans are
  unchanged by it.

A forward without a [MASK] token is then the base model's forward, operation for
operation (``torch.equal`` on logits in float32): the prompt, every committed block, and
block-size-1 verification are exactly the AR model's, and S2D2 / SSD / Spiffy verify with
the real target.  Only the [MASK] rows pay for the adapter (two thin matmuls per
projection over the masked rows).

The training side (:mod:`dspec.train.mask_adapter`) needs no gradient through the clean
stream: nothing a clean token computes depends on an adapter parameter.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .. import _backend, cpu
from ..ops.masks import pack_mask, unpack_mask
from .dense import dense, untracked

__all__ = ["MaskRows", "MaskLoraLinear", "MaskAdapter", "clean_causal_words", "TARGETS"]

_OPERANDS = "_dspec_lora_operands"

#: projection name -> the Block attribute that holds it
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class MaskRows:
    """The flat row index [R] of the [MASK] tokens of the current forward (None: no
    [MASK], every adapted projection is its base).  Per thread: forwards of one model on
    several Python threads each see their own rows."""

    __slots__ = ("_local",)

    def __init__(self):
        self._local = threading.local()

    @property
    def index(self) -> torch.Tensor | None:
        return getattr(self._local, "index", None)

    @index.setter
    def index(self, value: torch.Tensor | None) -> None:
        self._local.index = value

    def __reduce__(self):
        # copies and pickles of a model start with no forward in flight
        return (MaskRows, ())


def init_low_rank(
    module: nn.Linear, base: nn.Linear, rank: int, scale: float, generator: torch.Generator | None = None
) -> None:
    """``module`` takes ``base``'s ``weight`` / ``bias`` (frozen) and gains float32 ``lora_A``
    [rank, in] (nn.Linear's init, as PEFT) and ``lora_B`` [out, rank] (zeros: the update starts
    at 0), and ``scale``: the shared set-up of :class:`MaskLoraLinear` and
    :class:`dspec.models.lora.LoraLinear`."""
    nn.Module.__init__(module)
    module.in_features, module.out_features = base.in_features, base.out_features
    module.weight, module.bias = base.weight, base.bias
    module.weight.requires_grad_(False)
    if module.bias is not None:
        module.bias.requires_grad_(False)
    dev = base.weight.device
    module.lora_A = nn.Parameter(torch.empty(rank, module.in_features, device=dev, dtype=torch.float32))
    module.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, device=dev, dtype=torch.float32))
    nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5), generator=generator)
    module.scale = scale


class MaskLoraLinear(nn.Linear):
    """``nn.Linear`` (frozen ``weight`` / ``bias``) plus ``lora_A`` [r, in], ``lora_B`` [out, r]
    applied at the rows of ``rows.index`` only."""

    def __init__(
        self, base: nn.Linear, rank: int, scale: float, rows: MaskRows, generator: torch.Generator | None = None
    ):
        init_low_rank(self, base, rank, scale, generator)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.update(x, dense(x, self.weight, self.bias))

    def update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = the base projection of x (fresh, e.g. from ``dense_many``) plus the low-rank
        update at this forward's [MASK] rows (in place when dspec._C does it)."""
        idx = self.rows.index
        if idx is None:
            return y
        if self.fused_update(x, y, idx):
            a, bt = self.lora_operands()
            packed = self.lora_packed()
            _backend.extension().mask_lora(
                y.data_ptr(),
                x.data_ptr(),
                idx.data_ptr(),
                a.data_ptr(),
                bt.data_ptr(),
                float(self.scale),
                _backend.FLOAT_CODE[y.dtype],
                idx.numel(),
                y.numel() // self.out_features,
                self.in_features,
                self.out_features,
                self.lora_A.shape[0],
                cpu.kernel_threads(),
                _backend.FLOAT_CODE[a.dtype],
                "auto",
                0 if packed is None else packed.data_ptr(),
            )
            return y
        picked = x.reshape(-1, self.in_features).index_select(0, idx).to(self.lora_A.dtype)
        delta = F.linear(F.linear(picked, self.lora_A), self.lora_B) * self.scale
        return y.reshape(-1, self.out_features).index_add(0, idx, delta.to(y.dtype)).view(y.shape)

    def lora_operands(self, float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lora_A [rank, in], lora_B^T [rank, out])`` contiguous, as dspec._C.mask_lora reads
        them (16 outputs per vector step from B^T): in bfloat16 when every value of both is a
        bfloat16 number (the shipped adapter is stored so: the kernel widens them exactly, the
        same bits at half the bytes streamed per forward), else -- or with ``float32`` --
        float32.  Made on first use and kept with ``lora_B``; remade when lora_A or lora_B is
        modified in place (their version counters) or re-pointed."""
        a, b = self.lora_A, self.lora_B
        key = (a.data_ptr(), a._version, tuple(a.shape), b.data_ptr(), b._version, tuple(b.shape))
        kept = getattr(b, _OPERANDS, None)
        if kept is None or kept[0] != key:
            kept = (key, {})
            setattr(b, _OPERANDS, kept)
        forms = kept[1]
        form = "float32" if float32 else "auto"
        if form not in forms:
            a32, bt32 = a.detach().contiguous(), b.detach().t().contiguous()
            if form == "auto":
                a16, bt16 = a32.to(torch.bfloat16), bt32.to(torch.bfloat16)
                if torch.equal(a16.float(), a32) and torch.equal(bt16.float(), bt32):
                    a32, bt32 = a16, bt16
            forms[form] = (a32, bt32)
        return forms[form]

    def lora_packed(self) -> torch.Tensor | None:
        """The adapter laid out for dspec._C.mask_lora's AMX code (``mask_lora_pack``: bf16,
        made once and kept with the operands), or None where that code cannot run: no AMX-BF16
        here, a rank above 16, or an adapter whose values are not all bfloat16 numbers (packing
        would round them).  The kernel uses it for bfloat16 activations only."""
        ext = _backend.extension()
        rank = self.lora_A.shape[0]
        if not hasattr(ext, "mask_lora_pack") or not ext.mask_lora_has_amx(_backend.FLOAT_CODE[torch.bfloat16], rank):
            return None
        a, bt = self.lora_operands()
        if a.dtype is not torch.bfloat16:
            return None
        forms = getattr(self.lora_B, _OPERANDS)[1]
        if "amx" not in forms:
            packed = torch.empty(ext.mask_lora_packed_size(self.in_features, self.out_features), dtype=torch.bfloat16)
            ext.mask_lora_pack(
                a.data_ptr(),
                bt.data_ptr(),
                packed.data_ptr(),
                rank,
                self.in_features,
                self.out_features,
                _backend.FLOAT_CODE[torch.bfloat16],
            )
            forms["amx"] = packed
        return forms["amx"]

    def fused_update(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> bool:
        """Whether dspec._C.mask_lora adds the update in place (an inference call on the CPU:
        y fresh and contiguous, nothing for autograd or a tracer to see; the kernel reads A and
        B through :meth:`lora_operands`, contiguous copies, whatever their layout)."""
        a, b = self.lora_A, self.lora_B
        if (
            not x.is_cpu
            or y.dtype not in _backend.FLOAT_CODE
            or x.dtype is not y.dtype
            or a.dtype is not torch.float32
            or b.dtype is not torch.float32
            or idx.dtype is not torch.int64
            or not (x.is_contiguous() and y.is_contiguous() and idx.is_contiguous())
            or not idx.is_cpu
            or not hasattr(_backend.extension(), "mask_lora")
        ):
            return False
        return untracked(x, y, a, b, idx)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.shape[0]}, mask rows only"


class MaskAdapter(nn.Module):
    """The adapter of one model: mask-selective LoRA on ``targets`` of every layer and the
    [MASK] input embedding.  ``MaskAdapter.attach(model, rank=..)`` installs it (the model
    keeps it as ``model.mask_adapter``); ``scope(tokens, x)`` sets the [MASK] rows for one
    forward and returns the embeddings with the [MASK] row substituted."""

    def __init__(self, model, *, rank: int, alpha: float | None = None, targets=tuple(TARGETS)):
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        targets = tuple(targets)
        bad = [t for t in targets if t not in TARGETS]
        if not targets or bad:
            raise ValueError(f"targets must be a non-empty subset of {list(TARGETS)}, got {targets!r}")
        mask_id = model.config.mask_token_id
        if mask_id is None or not 0 <= mask_id < model.config.vocab_size:
            raise ValueError(f"model: a mask adapter needs a mask_token_id in the vocabulary, got {mask_id!r}")
        self.rank, self.alpha, self.targets = rank, float(alpha if alpha is not None else 2 * rank), targets
        self.mask_token_id = int(mask_id)
        self.rows = MaskRows()
        self.mask_embedding = nn.Parameter(model.embed_tokens.weight.detach()[mask_id].float().clone())

    @classmethod
    def attach(cls, model, *, seed: int = 0, **kw) -> "MaskAdapter":
        """Install a fresh adapter (``lora_B = 0``; ``lora_A`` drawn from ``seed``)."""
        if getattr(model, "mask_adapter", None) is not None:
            raise ValueError("model: already has a mask adapter")
        adapter = cls(model, **kw)
        scale = adapter.alpha / adapter.rank
        gen = torch.Generator(device=model.device).manual_seed(seed)
        for layer in model.layers:
            for name in adapter.targets:
                parent = getattr(layer, TARGETS[name])
                setattr(parent, name, MaskLoraLinear(getattr(parent, name), adapter.rank, scale, adapter.rows, gen))
        model.mask_adapter = adapter
        for p in model.parameters():  # inference by default; training calls trainable()
            p.requires_grad_(False)
        return adapter

    def trainable(self, model) -> list[nn.Parameter]:
        """Let gradients reach the adapter (LoRA matrices and the [MASK] row) and only it;
        returns those parameters."""
        params = []
        for name, p in model.named_parameters():
            on = name.endswith((".lora_A", ".lora_B")) or p is self.mask_embedding
            p.requires_grad_(on)
            if on:
                params.append(p)
        return params

    def begin(self, tokens: torch.Tensor, x: torch.Tensor, is_mask: torch.Tensor, any_mask: bool) -> torch.Tensor:
        """Set this forward's [MASK] rows (``is_mask`` [B, N]) and substitute the [MASK] input
        row into the embeddings ``x`` [B, N, H]."""
        if not any_mask:
            self.rows.index = None
            return x
        self.rows.index = is_mask.reshape(-1).nonzero().squeeze(1)
        return torch.where(is_mask[..., None], self.mask_embedding.to(x.dtype), x)

    def end(self) -> None:
        self.rows.index = None

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, targets={list(self.targets)}, mask_token_id={self.mask_token_id}"


def clean_causal_words(
    words: torch.Tensor | None, positions: torch.Tensor, is_mask: torch.Tensor, any_mask: bool
) -> torch.Tensor:
    """The packed suffix mask with every non-[MASK] query restricted to keys at positions <=
    its own (``ModelConfig.clean_causal``).

    words : int32 [N, W] (shared), [B, N, W] or None (every suffix token sees every one).
    positions : int64 [B, N]; is_mask : bool [B, N]; any_mask : ``is_mask.any()`` (host).
    Returns int32 [N, W] when the result is the same for every request, else [B, N, W].
    """
    batch, n = positions.shape
    rel = positions - positions[:, :1]
    shared = (words is None or words.dim() == 2) and not any_mask and (batch == 1 or bool((rel == rel[:1]).all()))
    if shared:
        rel = rel[:1]
    visible = (
        torch.ones(rel.shape[0], n, n, dtype=torch.bool, device=positions.device)
        if words is None
        else unpack_mask(words, n).expand(rel.shape[0], n, n)
        if words.dim() == 2
        else unpack_mask(words, n)
    )
    allowed = rel[:, None, :] <= rel[:, :, None]  # key pos <= query pos
    if any_mask:
        allowed = allowed | is_mask[:, :, None]
    out = pack_mask(visible & allowed)
    return out[0] if shared else out

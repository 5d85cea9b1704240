"""Training objectives and a fast training forward for dspec's lean transformer.

Training runs the modules of a ``dspec.models.Model`` directly (same weights, same RMSNorm /
RoPE / GQA / SwiGLU arithmetic) with ``torch.nn.functional.scaled_dot_product_attention``
and a dense additive mask, which is faster to train than the inference path
(``cascade_attention`` over a packed mask and a KV cache).  ``tests/test_train.py`` checks
that :func:`train_forward` gives the logits of ``Model.forward`` on the same sequence and
mask, so trained weights decode exactly as trained.

Objectives
----------
- :func:`causal_lm_loss`: next-token cross-entropy (tiny-ar).
- :func:`block_diffusion_loss`: SDAR / BD3-LM masked denoising with the "2L" layout.  The
  model sees ``[x_noisy ; x_clean]`` (2L tokens, both copies at positions 0..L-1) under
  :func:`block_diffusion_mask`: noisy block b sees the clean blocks < b and itself
  (bidirectionally); clean block b sees the clean blocks <= b; nothing sees the noisy copy
  from outside its block.  This is exactly what decoding computes: the committed blocks in
  the KV cache (clean, block-causal) plus the current block of [MASK]s and drafts.
  Noise: per block, the number of masked tokens k is uniform in 1..b (mask ratio
  t = k / b in (0, 1]; never an empty block, and block size 1 is then always fully masked,
  i.e. plain autoregressive training with position-aligned logits), the k positions
  uniform within the block.  Loss on masked positions only: ``weighting="mean"`` (default)
  is the mean cross-entropy over masked tokens; ``"elbo"`` weights each by 1/t = b/k and
  divides by the number of tokens (the BD3-LM bound, in nats per token).  ``mean`` trains a
  tiny model faster (the 1/t weights reach 16 at block 16 and make the gradient noisy);
  ``elbo`` is the one to report as a likelihood bound.
  ``shifted=True`` (Fast-dLLM v2 / Dream style right-shifted logits, used when adapting a
  Llama/Qwen2 causal LM) predicts slot j from the logits at j - 1: the first slot of noisy
  block b from the clean copy's last token of block b - 1, as decoding does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..models.transformer import Model, rope_tables

__all__ = [
    "train_forward",
    "causal_mask",
    "block_diffusion_mask",
    "additive_mask",
    "causal_lm_loss",
    "BlockDiffusionBatch",
    "block_diffusion_batch",
    "block_diffusion_loss",
    "LossOutput",
]


class LossOutput(NamedTuple):
    """loss: scalar to back-propagate; nll_sum: summed cross-entropy (nats) over the
    predicted tokens; count: number of predicted tokens (floats, detached)."""

    loss: torch.Tensor
    nll_sum: torch.Tensor
    count: torch.Tensor


# ------------------------------------------------------------------------------- forward


def train_forward(
    model: Model,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    logits_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of ``model`` on ``tokens`` with a dense attention mask, differentiable.

    Parameters
    ----------
    model : a ``dspec.models.Model`` (its parameters may require grad).
    tokens : [B, N] int64 token ids.
    positions : [B, N] or [N] int64 absolute positions (RoPE).
    attn_mask : None, bool [N, N] / [B, N, N] (True = may attend) or an additive float mask
        of those shapes (0 / -inf).  Every row must see at least one key.
    is_causal : use SDPA's causal path instead of a mask (``attn_mask`` must be None).
    logits_index : optional [B, K] int64 positions at which to compute logits (saves the
        LM head elsewhere); default every position.

    Returns
    -------
    logits : [B, N, V] (or [B, K, V]) in the autocast / model dtype.
    """
    cfg = model.config
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, N], got {list(tokens.shape)}")
    batch, n = tokens.shape
    if positions.dim() == 1:
        positions = positions[None].expand(batch, n)
    if positions.shape != tokens.shape:
        raise ValueError(f"positions must be [B, N] = {[batch, n]} or [N], got {list(positions.shape)}")
    if is_causal and attn_mask is not None:
        raise ValueError("give attn_mask or is_causal=True, not both")
    mask = None
    if attn_mask is not None:
        mask = attn_mask
        if mask.dtype == torch.bool:
            mask = additive_mask(mask)
        if mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, N, N]: broadcast over heads
    x = model.embed_tokens(tokens)
    if cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale
    cos, sin = rope_tables(positions, model._rope(x.device))
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.rotated_qkv(layer.input_layernorm(x), cos, sin)
        m = mask.to(q.dtype) if mask is not None else None
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=m,
            is_causal=is_causal,
            enable_gqa=hq != hkv,
        )
        x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, n, hq * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.norm(x)
    if logits_index is not None:
        x = torch.gather(x, 1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
    logits = F.linear(x, model.output_weight)
    if cfg.logit_scale != 1.0:
        logits = logits * cfg.logit_scale
    return logits


def additive_mask(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """bool mask (True = may attend) -> additive 0 / -inf mask."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


# ------------------------------------------------------------------------------- masks


def causal_mask(n: int, device=None) -> torch.Tensor:
    """bool [n, n]: i sees j <= i."""
    ar = torch.arange(n, device=device)
    return ar[None, :] <= ar[:, None]


def block_diffusion_mask(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """The 2L training mask, bool [2L, 2L] (True = may attend), rows/columns
    ``[noisy 0..L-1 ; clean 0..L-1]``, blocks ``position // block_size``:

    - noisy i sees noisy j iff block(j) == block(i), and clean j iff block(j) < block(i);
    - clean i sees clean j iff block(j) <= block(i), and no noisy token.

    Block size 1 gives a causal LM with position-aligned logits: noisy i ([MASK]) sees the
    clean tokens < i and itself.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    blk = torch.arange(seq_len, device=device) // block_size
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    upto = blk[None, :] <= blk[:, None]
    none = torch.zeros(seq_len, seq_len, dtype=torch.bool, device=device)
    top = torch.cat([same, before], dim=1)  # noisy queries
    bottom = torch.cat([none, upto], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


# ------------------------------------------------------------------------------- losses


def _check_tokens(tokens):
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(
            f"tokens must be an int tensor [B, L], got "
            f"{getattr(tokens, 'dtype', type(tokens))} {list(getattr(tokens, 'shape', []))}"
        )


def causal_lm_loss(model: Model, tokens: torch.Tensor) -> LossOutput:
    """Next-token cross-entropy of ``tokens`` [B, L] (mean over the B * (L - 1) predictions)."""
    _check_tokens(tokens)
    if tokens.shape[1] < 2:
        raise ValueError("tokens needs L >= 2 for a next-token loss")
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    logits = train_forward(model, tokens, pos, is_causal=True)[:, :-1]
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum")
    count = torch.tensor(float(tokens.shape[0] * (tokens.shape[1] - 1)), device=tokens.device)
    return LossOutput(nll / count, nll.detach(), count)


class BlockDiffusionBatch(NamedTuple):
    """inputs [B, 2L] (noisy copy then clean copy), positions [2L], mask bool [2L, 2L],
    masked bool [B, L] (noisy positions holding [MASK]), ratio float [B, L] (t = k / b of
    each position's block), targets [B, L] (the clean tokens), block_size."""

    inputs: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    masked: torch.Tensor
    ratio: torch.Tensor
    targets: torch.Tensor
    block_size: int


def block_diffusion_batch(
    tokens: torch.Tensor, block_size: int, mask_token_id: int, *, generator: torch.Generator | None = None
) -> BlockDiffusionBatch:
    """Noise ``tokens`` [B, L] block by block and lay out the 2L training sequence.

    Per block of ``block_size`` tokens (the last block may be shorter: its size counts), k
    is uniform in 1..size and k uniformly chosen positions become ``mask_token_id``.
    ``generator`` (on the tokens' device) makes the noise reproducible.
    """
    _check_tokens(tokens)
    batch, length = tokens.shape
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be an int >= 0, got {mask_token_id!r}")
    dev = tokens.device
    nblocks = -(-length // block_size)
    pad = nblocks * block_size - length
    sizes = torch.full((nblocks,), block_size, device=dev)
    sizes[-1] = block_size - pad
    # k ~ U{1..size}: floor(u * size) + 1
    u = torch.rand(batch, nblocks, generator=generator, device=dev)
    k = (u * sizes).floor().long().clamp_(max=sizes - 1) + 1  # [B, nb]
    # a random rank of each position within its block (padding slots ranked last)
    scores = torch.rand(batch, nblocks * block_size, generator=generator, device=dev)
    if pad:
        scores[:, length:] = 2.0
    rank = scores.view(batch, nblocks, block_size).argsort(-1).argsort(-1)  # [B, nb, bs]
    masked = (rank < k[..., None]).view(batch, -1)[:, :length]
    ratio = (k.float() / sizes.float())[..., None].expand(-1, -1, block_size).reshape(batch, -1)[:, :length]
    noisy = torch.where(masked, torch.full_like(tokens, mask_token_id), tokens)
    inputs = torch.cat([noisy, tokens], dim=1)
    pos = torch.arange(length, device=dev)
    return BlockDiffusionBatch(
        inputs, torch.cat([pos, pos]), block_diffusion_mask(length, block_size, dev), masked, ratio, tokens, block_size
    )


def block_diffusion_loss(
    model: Model,
    tokens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    *,
    generator: torch.Generator | None = None,
    weighting: str = "mean",
    shifted: bool = False,
    batch: BlockDiffusionBatch | None = None,
) -> LossOutput:
    """Masked-denoising loss of a block-diffusion model on clean ``tokens`` [B, L].

    weighting : "mean" (mean cross-entropy over masked tokens) or "elbo" (each masked
        token weighted 1/t, summed and divided by B * L: the BD3-LM bound per token).
    shifted : right-shifted logits (slot j predicted at j - 1, the first slot of block b
        from the clean copy's last token of block b - 1; position 0 is not predicted).
    batch : a precomputed :func:`block_diffusion_batch` (tests); drawn from ``generator``
        otherwise.

    ``nll_sum`` / ``count`` are the plain masked-token cross-entropy sum and count.
    """
    if weighting not in ("mean", "elbo"):
        raise ValueError(f"weighting must be 'mean' or 'elbo', got {weighting!r}")
    if batch is None:
        batch = block_diffusion_batch(tokens, block_size, mask_token_id, generator=generator)
    b, length = batch.targets.shape
    if shifted:
        logits = train_forward(model, batch.inputs, batch.positions, batch.mask)  # [B, 2L, V]
        # slot j <- logits at noisy j - 1 inside the block, clean j - 1 at a block start
        j = torch.arange(length, device=tokens.device)
        start = (j % block_size) == 0
        src = torch.where(start, length + j - 1, j - 1)
        keep = j > 0
        src = src[keep]
        pred = logits[:, src]
        targets, masked, ratio = (batch.targets[:, keep], batch.masked[:, keep], batch.ratio[:, keep])
    else:
        # position-aligned: only the noisy copy is predicted (skip the LM head on the clean copy)
        index = torch.arange(length, device=tokens.device).expand(b, -1)
        pred = train_forward(model, batch.inputs, batch.positions, batch.mask, logits_index=index)
        targets, masked, ratio = batch.targets, batch.masked, batch.ratio
    ce = F.cross_entropy(pred.float().reshape(-1, pred.shape[-1]), targets.reshape(-1), reduction="none").view(
        targets.shape
    )
    ce = ce * masked
    count = masked.sum().float()
    nll = ce.sum()
    if weighting == "mean":
        loss = nll / count.clamp(min=1)
    else:
        loss = (ce / ratio).sum() / float(targets.numel())
    return LossOutput(loss, nll.detach(), count.detach())

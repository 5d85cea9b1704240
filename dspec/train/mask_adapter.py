"""Training a mask-selective block-diffusion adapter (``dspec.models.mask_adapter``).

The model is a frozen causal LM plus a LoRA that acts only at [MASK] rows and a trained
[MASK] input row; clean tokens attend causally.  Training uses the "2L" view of block
diffusion, split into its two streams because only one of them can learn:

- the **clean stream** (the sequence itself, causal attention, no adapter) is exactly the
  frozen base model: it runs once under ``no_grad`` and leaves its per-layer keys/values;
- the **noisy stream** (each block with k ~ U{1..b} positions masked) runs with gradients:
  noisy position i of block c attends to the clean keys of blocks < c and to its own
  block: a [MASK] query to the whole block, a clean query to block positions <= i.

Right-shifted (Fast-dLLM v2) prediction: slot j is read from the logits of slot j - 1 of
the noisy stream; the first slot of a block would be read from the clean stream, which has
no trainable parameter, so it is left out of the loss (block sizes >= 2).  The loss is the
mean cross-entropy of the masked response tokens.

:func:`two_stream_logits` is checked in ``tests/test_mask_adapter.py`` against the inference
forward (``Model.forward`` of the 2L layout under the clean-causal rule), so trained weights
decode as trained.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.mask_adapter import MaskAdapter
from ..models.transformer import Model, rope_tables
from .objectives import LossOutput, additive_mask

__all__ = ["two_stream_logits", "noisy_mask", "mask_adapter_loss", "noise_blocks"]


def noisy_mask(positions: torch.Tensor, is_mask: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool [B, L, 2L]: what noisy query i sees among (clean keys, noisy keys)."""
    blk = positions // block_size                                            # [B, L]
    same = blk[:, :, None] == blk[:, None, :]
    before = blk[:, None, :] < blk[:, :, None]
    causal = positions[:, None, :] <= positions[:, :, None]
    see_clean = before & valid[:, None, :]
    see_noisy = same & (is_mask[:, :, None] | causal) & valid[:, None, :]
    see = torch.cat([see_clean, see_noisy], dim=-1)
    eye = torch.eye(see.shape[1], dtype=torch.bool, device=see.device)
    see[:, :, see.shape[1]:] |= eye & ~valid[:, :, None]                     # padding sees itself
    return see


def _sdpa(q, k, v, mask, gqa):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=gqa).transpose(1, 2)


def two_stream_logits(model: Model, clean: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor,
                      block_size: int, logits_index: torch.Tensor) -> torch.Tensor:
    """Logits of the noisy stream at ``logits_index`` [B, K] (differentiable in the adapter).

    clean, noisy : int64 [B, L] (noisy = clean with some positions set to [MASK]);
    valid : bool [B, L] (right padding False).  Positions are 0 .. L-1.
    """
    adapter: MaskAdapter = model.mask_adapter
    if adapter is None:
        raise ValueError("model: attach a MaskAdapter first")
    cfg = model.config
    batch, length = clean.shape
    dev = clean.device
    positions = torch.arange(length, device=dev).expand(batch, length)
    cos, sin = rope_tables(positions, model._rope(dev))
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    gqa = hq != hkv
    # clean stream: the frozen base, causal (padding at the end sees only real tokens before it)
    with torch.no_grad():
        adapter.end()
        kv = []
        x = model.embed_tokens(clean)
        for layer in model.layers:
            attn = layer.self_attn
            q, k, v = attn.rotated_qkv(layer.input_layernorm(x), cos, sin)
            kv.append((k, v))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=gqa).transpose(1, 2)
            x = x + attn.o_proj(o.reshape(batch, length, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    is_mask = noisy == adapter.mask_token_id
    mask = additive_mask(noisy_mask(positions, is_mask, valid, block_size))[:, None]
    x = adapter.begin(noisy, model.embed_tokens(noisy), is_mask, bool(is_mask.any()))
    try:
        for layer, (kc, vc) in zip(model.layers, kv):
            attn = layer.self_attn
            q, k, v = attn.rotated_qkv(layer.input_layernorm(x), cos, sin)
            o = _sdpa(q, torch.cat([kc.to(k.dtype), k], 1), torch.cat([vc.to(v.dtype), v], 1), mask.to(q.dtype), gqa)
            x = x + attn.o_proj(o.reshape(batch, length, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    finally:
        adapter.end()
    x = model.norm(x)
    x = torch.gather(x, 1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
    return F.linear(x, model.output_weight)


def noise_blocks(clean: torch.Tensor, valid: torch.Tensor, block_size: int, mask_token_id: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy [B, L], masked bool [B, L]): per block, k ~ U{1..b} uniformly chosen valid
    positions become [MASK] (a block with no valid position stays clean)."""
    batch, length = clean.shape
    nblocks = -(-length // block_size)
    pad = nblocks * block_size - length
    v = F.pad(valid, (0, pad)).view(batch, nblocks, block_size)
    sizes = v.sum(-1)                                                         # [B, nb]
    u = torch.rand(batch, nblocks, generator=generator, device=clean.device)
    k = (u * sizes).floor().long().minimum(sizes - 1) + 1
    scores = torch.rand(batch, nblocks, block_size, generator=generator, device=clean.device)
    scores = scores.masked_fill(~v, 2.0)
    rank = scores.argsort(-1).argsort(-1)
    masked = ((rank < k[..., None]) & v).view(batch, -1)[:, :length]
    return torch.where(masked, torch.full_like(clean, mask_token_id), clean), masked


def mask_adapter_loss(model: Model, clean: torch.Tensor, valid: torch.Tensor, loss_from: torch.Tensor,
                      block_size: int, *, generator: torch.Generator | None = None) -> LossOutput:
    """Mean cross-entropy of the masked tokens at positions >= ``loss_from`` [B] (e.g. the
    prompt length) that are not the first slot of their block (right-shifted prediction)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an int >= 2 (a block's first slot is the base model's), got {block_size!r}")
    adapter = model.mask_adapter
    noisy, masked = noise_blocks(clean, valid, block_size, adapter.mask_token_id, generator)
    batch, length = clean.shape
    j = torch.arange(length, device=clean.device)
    want = masked & (j % block_size != 0) & (j >= loss_from[:, None])          # [B, L]
    # gather only the wanted rows' logits (slot j from noisy row j - 1), padded per request
    count = want.sum(1)
    k = max(int(count.max()), 1)
    order = torch.sort((~want).to(torch.int8), dim=1, stable=True).indices[:, :k]      # wanted first
    have = torch.arange(k, device=clean.device)[None] < count[:, None]
    src = (order - 1).clamp_min(0)
    logits = two_stream_logits(model, clean, noisy, valid, block_size, src)
    targets = clean.gather(1, order)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(batch, k)
    ce = ce * have
    n = have.sum().float()
    return LossOutput(ce.sum() / n.clamp_min(1), ce.sum().detach(), n.detach())


def mask_diffusion_model(base: Model, *, block_size: int, mask_token_id: int, rank: int = 16,
                         alpha: float | None = None, targets=None) -> Model:
    """A copy of the causal ``base`` as a right-shifted, block-causal, clean-causal diffusion
    model with a fresh :class:`MaskAdapter` (``B = 0``: the model still computes exactly the
    base everywhere; at [MASK] rows it starts from the base with the [MASK] token's own
    embedding row)."""
    if base.attention != "causal" or base.mask_adapter is not None:
        raise ValueError(f"base: a causal LM without an adapter is needed, got {base.family!r} ({base.attention})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or \
            not 0 <= mask_token_id < base.config.vocab_size:
        raise ValueError(f"mask_token_id must be an id in [0, {base.config.vocab_size}), got {mask_token_id!r}")
    cfg = base.config.replace(family="fast_dllm_v2", attention="block_causal", shifted=True, block_size=block_size,
                              mask_token_id=mask_token_id, clean_causal=True)
    model = Model(cfg, tokenizer=base.tokenizer, device=base.device, dtype=base.dtype)
    model.load_state_dict(base.state_dict())
    model.name_or_path = base.name_or_path
    kw = {} if targets is None else {"targets": tuple(targets)}
    MaskAdapter.attach(model, rank=rank, alpha=alpha, **kw)
    return model

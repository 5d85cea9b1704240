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
mean cross-entropy of the masked response tokens, optionally mixed with the KL to the base
model's own next-token distribution at each of them (``distill``: the clean stream computes
it but for the output head; the base model is the verifier of S2D2, so its distribution is
the target the drafts are judged by).

:func:`two_stream_logits` is checked in ``tests/test_mask_adapter.py`` against the inference
forward (``Model.forward`` of the 2L layout under the clean-causal rule), so trained weights
decode as trained.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._cli import dumps, run_command
from ..models.adapters import (
    MASK_ADAPTER_FORMAT as ADAPTER_FORMAT,
    init_mask_adapter,
    is_mask_adapter,
    load_mask_adapter,
    mask_diffusion_model,
    save_mask_adapter,
)
from ..models.mask_adapter import MaskAdapter
from ..models.transformer import Model, rope_tables
from .data_engine import heldout_split
from .loop import BudgetedLoop
from .objectives import additive_mask
from .trainer import lr_at

__all__ = [
    "two_stream_logits",
    "noisy_mask",
    "frozen_projections_bf16",
    "mask_adapter_loss",
    "MaskAdapterLoss",
    "noise_blocks",
    "mask_diffusion_model",
    "save_mask_adapter",
    "load_mask_adapter",
    "is_mask_adapter",
    "MaskAdapterConfig",
    "MaskAdapterTrainer",
    "ADAPTER_FORMAT",
]


CHECKPOINT_KEYS = ("adapter", "opt", "step", "total_steps", "log", "evals", "wall_s")


def read_checkpoint(path, *, map_location="cpu") -> dict:
    """A mask-adapter run's ``checkpoint.pt``, read without running code from it
    (:func:`dspec.train.state_files.load_state`); ValueError when it is not one."""
    from .state_files import load_state

    return load_state(path, "resume: checkpoint.pt", keys=CHECKPOINT_KEYS, map_location=map_location)


def noisy_mask(positions: torch.Tensor, is_mask: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool [B, L, 2L]: what noisy query i sees among (clean keys, noisy keys)."""
    blk = positions // block_size  # [B, L]
    same = blk[:, :, None] == blk[:, None, :]
    before = blk[:, None, :] < blk[:, :, None]
    causal = positions[:, None, :] <= positions[:, :, None]
    see_clean = before & valid[:, None, :]
    see_noisy = same & (is_mask[:, :, None] | causal) & valid[:, None, :]
    see = torch.cat([see_clean, see_noisy], dim=-1)
    eye = torch.eye(see.shape[1], dtype=torch.bool, device=see.device)
    see[:, :, see.shape[1] :] |= eye & ~valid[:, :, None]  # padding sees itself
    return see


def _sdpa(q, k, v, mask, gqa):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    ).transpose(1, 2)


def two_stream_logits(
    model: Model,
    clean: torch.Tensor,
    noisy: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    logits_index: torch.Tensor,
    *,
    teacher: bool = False,
):
    """Logits of the noisy stream at ``logits_index`` [B, K] (differentiable in the adapter).

    clean, noisy : int64 [B, L] (noisy = clean with some positions set to [MASK]);
    valid : bool [B, L] (right padding False).  Positions are 0 .. L-1.
    teacher : also return the clean stream's logits at ``logits_index`` (no gradient): the
        base model's next-token distribution given the true prefix, which the clean stream
        computes anyway but for its output head -> (student, teacher).
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
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
            ).transpose(1, 2)
            x = x + attn.o_proj(o.reshape(batch, length, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        clean_x = x
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
    student = F.linear(x, model.output_weight)
    if not teacher:
        return student
    with torch.no_grad():
        t = torch.gather(model.norm(clean_x), 1, logits_index[..., None].expand(-1, -1, clean_x.shape[-1]))
        return student, F.linear(t, model.output_weight)


def frozen_projections_bf16(model: Model) -> int:
    """Hold the frozen projection weights of ``model``'s layers (the ``MaskLoraLinear`` bases
    and any other frozen ``nn.Linear``) in bfloat16 for training under bf16 autocast; returns
    how many were converted.

    Autocast rounds a float32 weight to bfloat16 on every matmul anyway, so the noisy stream
    computes the same numbers without a per-call copy of 135M weights; the no-grad clean
    stream, which would otherwise take float32 matmuls, runs in bf16 like the noisy one
    (measured on an AMX Xeon: the clean stream of 8 x 256 tokens 3.0 s in float32, 1.0 s so). The
    LoRA matrices, the [MASK] row, the norms and the tied embedding / head stay float32.
    The model is for training only afterwards (a forward outside autocast would mix dtypes).
    """
    count = 0
    for layer in model.layers:
        for module in layer.modules():
            if (
                isinstance(module, nn.Linear)
                and not module.weight.requires_grad
                and module.weight.dtype == torch.float32
            ):
                module.weight.data = module.weight.data.to(torch.bfloat16)
                if module.bias is not None and not module.bias.requires_grad:
                    module.bias.data = module.bias.data.to(torch.bfloat16)
                count += 1
    return count


def noise_blocks(
    clean: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy [B, L], masked bool [B, L]): per block, k ~ U{1..b} uniformly chosen valid
    positions become [MASK] (a block with no valid position stays clean)."""
    batch, length = clean.shape
    nblocks = -(-length // block_size)
    pad = nblocks * block_size - length
    v = F.pad(valid, (0, pad)).view(batch, nblocks, block_size)
    sizes = v.sum(-1)  # [B, nb]
    u = torch.rand(batch, nblocks, generator=generator, device=clean.device)
    k = (u * sizes).floor().long().minimum(sizes - 1) + 1
    scores = torch.rand(batch, nblocks, block_size, generator=generator, device=clean.device)
    scores = scores.masked_fill(~v, 2.0)
    rank = scores.argsort(-1).argsort(-1)
    masked = ((rank < k[..., None]) & v).view(batch, -1)[:, :length]
    return torch.where(masked, torch.full_like(clean, mask_token_id), clean), masked


class MaskAdapterLoss(NamedTuple):
    """``objectives.LossOutput``'s fields plus ``agree``: how many of the ``count`` predicted
    tokens have the student's argmax equal to the base model's (the teacher's, given the
    true prefix) -- what a greedy self-speculative verification accepts; NaN unless asked."""

    loss: torch.Tensor
    nll_sum: torch.Tensor
    count: torch.Tensor
    agree: torch.Tensor


def mask_adapter_loss(
    model: Model,
    clean: torch.Tensor,
    valid: torch.Tensor,
    loss_from: torch.Tensor,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
    distill: float = 0.0,
    agreement: bool = False,
) -> MaskAdapterLoss:
    """Loss over the masked tokens at positions >= ``loss_from`` [B] (e.g. the prompt length)
    that are not the first slot of their block (right-shifted prediction).

    ``distill`` = a in [0, 1]: the loss is ``(1 - a) * CE(data token) + a * KL(teacher ||
    student)``, the teacher being the frozen base model's distribution at the same slot given
    the true prefix (the clean stream's logits, free but for its output head): the soft
    target tells the adapter which tokens the verifier would pick, where a sampled data token
    tells it one draw.  ``nll_sum`` is always the data tokens' cross-entropy, so held-out
    losses compare across ``distill``.  ``agreement``: count the argmax agreements too.
    """
    if not isinstance(distill, (int, float)) or isinstance(distill, bool) or not 0.0 <= distill <= 1.0:
        raise ValueError(f"distill must be a number in [0, 1], got {distill!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"block_size must be an int >= 2 (a block's first slot is the base model's), got {block_size!r}"
        )
    adapter = model.mask_adapter
    noisy, masked = noise_blocks(clean, valid, block_size, adapter.mask_token_id, generator)
    batch, length = clean.shape
    j = torch.arange(length, device=clean.device)
    want = masked & (j % block_size != 0) & (j >= loss_from[:, None])  # [B, L]
    # gather only the wanted rows' logits (slot j from noisy row j - 1), padded per request
    count = want.sum(1)
    k = max(int(count.max()), 1)
    order = torch.sort((~want).to(torch.int8), dim=1, stable=True).indices[:, :k]  # wanted first
    have = torch.arange(k, device=clean.device)[None] < count[:, None]
    src = (order - 1).clamp_min(0)
    teacher = distill > 0 or agreement
    out = two_stream_logits(model, clean, noisy, valid, block_size, src, teacher=teacher)
    logits, teacher_logits = out if teacher else (out, None)
    targets = clean.gather(1, order)
    log_q = F.log_softmax(logits.float(), -1)  # [B, k, V]
    ce = -log_q.gather(-1, targets[..., None])[..., 0] * have
    n = have.sum().float()
    loss = ce.sum()
    agree = torch.tensor(float("nan"))
    if teacher:
        log_p = F.log_softmax(teacher_logits.float(), -1)
        if distill > 0:
            kl = (log_p.exp() * (log_p - log_q)).sum(-1) * have
            loss = (1.0 - distill) * loss + distill * kl.sum()
        if agreement:
            agree = ((logits.argmax(-1) == teacher_logits.argmax(-1)) & have).sum().float()
    return MaskAdapterLoss(loss / n.clamp_min(1), ce.sum().detach(), n.detach(), agree)


# ---------------------------------------------------------------------- training


@dataclass
class MaskAdapterConfig:
    """Recipe settings.

    rank, alpha, targets : the adapter.  block_size : the default decoding block size
        written with it.  block_sizes / block_weights : the block size drawn per step.
    batch_size : sequences per step; max_len : longer sequences are cut.
    lr, min_lr, warmup_steps, max_steps, weight_decay, grad_clip : AdamW + cosine.
    eval_block_sizes, heldout_sequences : the held-out loss (fixed noise) and its size.
    heldout_start : hold out only sequences from this index on (a later round on grown data:
        the earlier sequence count).
    eval_every : steps; checkpoint_every_s : seconds.  autocast : "auto" (bf16 on CUDA and
    on CPUs with native bf16 matmul), "bf16", "none".
    distill : the weight a in [0, 1] of the KL to the base model's distribution in the loss
        (:func:`mask_adapter_loss`); 0 trains on the data tokens alone.
    """

    rank: int = 16
    alpha: float | None = None
    targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    mask_token: str = "<filename>"
    block_size: int = 4
    block_sizes: tuple = (2, 4, 8, 16)
    block_weights: tuple = (0.2, 0.4, 0.25, 0.15)
    batch_size: int = 8
    max_len: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    max_steps: int = 100_000
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_block_sizes: tuple = (2, 4, 8)
    heldout_sequences: int = 64
    heldout_start: int = 0
    eval_every: int = 100
    checkpoint_every_s: float = 600.0
    autocast: str = "auto"
    seed: int = 0
    distill: float = 0.0

    def __post_init__(self):
        for name in ("rank", "block_size", "batch_size", "max_len", "max_steps", "eval_every", "heldout_sequences"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.block_sizes, self.block_weights = tuple(self.block_sizes), tuple(self.block_weights)
        self.eval_block_sizes, self.targets = tuple(self.eval_block_sizes), tuple(self.targets)
        sizes = self.block_sizes + self.eval_block_sizes
        if not self.block_sizes or any(not isinstance(b, int) or b < 2 for b in sizes):
            raise ValueError(
                f"block_sizes and eval_block_sizes must hold ints >= 2, got {self.block_sizes}, {self.eval_block_sizes}"
            )
        if (
            len(self.block_weights) != len(self.block_sizes)
            or any(w < 0 for w in self.block_weights)
            or sum(self.block_weights) <= 0
        ):
            raise ValueError(f"block_weights must be {len(self.block_sizes)} weights >= 0, got {self.block_weights}")
        if (
            isinstance(self.distill, bool)
            or not isinstance(self.distill, (int, float))
            or not 0.0 <= self.distill <= 1.0
        ):
            raise ValueError(f"distill must be a number in [0, 1], got {self.distill!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be 'auto', 'bf16' or 'none', got {self.autocast!r}")
        if isinstance(self.heldout_start, bool) or not isinstance(self.heldout_start, int) or self.heldout_start < 0:
            raise ValueError(f"heldout_start must be an int >= 0, got {self.heldout_start!r}")


class MaskAdapterTrainer(BudgetedLoop):
    """Trains the mask adapter of ``model`` (from :func:`mask_diffusion_model`) on
    ``sequences`` [(ids, prompt_len)]: the loss covers response tokens (positions >= the
    prompt length); the prompt is context.  ``heldout_sequences`` of them are held out."""

    progress_desc = "train mask adapter"

    def __init__(
        self,
        model: Model,
        sequences,
        cfg: MaskAdapterConfig,
        out_dir,
        *,
        base_name: str,
        base_fingerprint: str,
        data_info: dict | None = None,
        progress: bool = True,
    ):
        if model.mask_adapter is None:
            raise ValueError("model: attach a MaskAdapter first (mask_diffusion_model)")
        self.model, self.cfg, self.out = model, cfg, Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.base_name, self.base_fingerprint = base_name, base_fingerprint
        self.data_info = dict(data_info or {})
        self.progress = progress
        self.device = model.device
        usable = [len(s) - p >= 2 for s, p in sequences]
        seqs = [(list(s[: cfg.max_len]), min(int(p), cfg.max_len - 1)) for (s, p), ok in zip(sequences, usable) if ok]
        if len(seqs) < 2:
            raise ValueError("sequences: need at least 2 with a response of >= 2 tokens")
        start = sum(usable[: cfg.heldout_start])
        if start >= len(seqs):
            raise ValueError(f"heldout_start ({cfg.heldout_start}) leaves no sequence to hold out")
        n_held = min(cfg.heldout_sequences, max(1, (len(seqs) - start) // 10))
        held, train = heldout_split(len(seqs), n_held, seed=cfg.seed, start=start)
        self.heldout = [seqs[i] for i in held]
        self.train_set = [seqs[i] for i in train]
        params = model.mask_adapter.trainable(model)
        if self._autocast_on():
            frozen_projections_bf16(model)
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step, self.total_steps, self.wall_s = 0, None, 0.0
        self.log: list[dict] = []
        self.evals: list[dict] = []

    def _gen(self, step: int, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 7919 + salt)

    def _rows(self, rows):
        length = max(len(s) for s, _ in rows)
        clean = torch.zeros(len(rows), length, dtype=torch.int64)
        valid = torch.zeros(len(rows), length, dtype=torch.bool)
        for b, (s, _) in enumerate(rows):
            clean[b, : len(s)] = torch.tensor(s)
            valid[b, : len(s)] = True
        starts = torch.tensor([p for _, p in rows])
        return clean.to(self.device), valid.to(self.device), starts.to(self.device)

    def _autocast_on(self) -> bool:
        from ..cpu import native_bf16

        auto = self.device.type == "cuda" or (self.device.type == "cpu" and native_bf16())
        return self.cfg.autocast == "bf16" or (self.cfg.autocast == "auto" and auto)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast_on())

    def block_size_at(self, step: int) -> int:
        g = self._gen(step, salt=5)
        w = torch.tensor(self.cfg.block_weights, dtype=torch.float64)
        return self.cfg.block_sizes[int(torch.multinomial(w, 1, generator=g))]

    def train_step(self) -> float:
        cfg = self.cfg
        lr = lr_at(self.step, cfg, self.total_steps or cfg.max_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        g = self._gen(self.step)
        pick = torch.randint(len(self.train_set), (cfg.batch_size,), generator=g).tolist()
        clean, valid, starts = self._rows([self.train_set[i] for i in pick])
        bs = self.block_size_at(self.step)
        with self._autocast():
            out = mask_adapter_loss(self.model, clean, valid, starts, bs, generator=g, distill=cfg.distill)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for group in self.opt.param_groups for p in group["params"]], cfg.grad_clip)
        self.opt.step()
        self.step += 1
        value = float(out.loss.detach())
        self.log.append({"step": self.step, "loss": value, "lr": lr, "block_size": bs})
        return value

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out masked-token loss per eval block size (fixed noise), and ``agree_bs{b}``:
        the fraction of those tokens whose argmax is the base model's; returns the mean loss."""
        record = {"step": self.step}
        for bs in self.cfg.eval_block_sizes:
            nll, count, agree = 0.0, 0.0, 0.0
            for start in range(0, len(self.heldout), self.cfg.batch_size):
                clean, valid, starts = self._rows(self.heldout[start : start + self.cfg.batch_size])
                with self._autocast():
                    out = mask_adapter_loss(
                        self.model, clean, valid, starts, bs, generator=self._gen(start, salt=1000 + bs), agreement=True
                    )
                nll += float(out.nll_sum)
                count += float(out.count)
                agree += float(out.agree)
            record[f"bs{bs}"] = nll / max(count, 1.0)
            record[f"agree_bs{bs}"] = agree / max(count, 1.0)
        evals = self.cfg.eval_block_sizes
        record["heldout_loss"] = sum(record[f"bs{b}"] for b in evals) / len(evals)
        self.evals.append(record)
        return record["heldout_loss"]

    def state_dict(self) -> dict:
        adapter = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return {
            "adapter": adapter,
            "opt": self.opt.state_dict(),
            "step": self.step,
            "total_steps": self.total_steps,
            "log": self.log,
            "evals": self.evals,
            "wall_s": self.wall_s,
            "cfg": asdict(self.cfg),
            "base_fingerprint": self.base_fingerprint,
        }

    def save_checkpoint(self) -> Path:
        path = self.out / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        self.export()
        return path

    def resume(self, state: dict | None = None) -> bool:
        """Load ``checkpoint.pt`` when present (or ``state``, read earlier by
        :func:`read_checkpoint`); True if it did."""
        path = self.out / "checkpoint.pt"
        if state is None:
            if not path.is_file():
                return False
            state = read_checkpoint(path, map_location=self.device)
        if state.get("base_fingerprint") != self.base_fingerprint:
            raise ValueError(f"resume: {path} was trained on other base weights")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state["adapter"].items():
                params[n].copy_(t)
        self.opt.load_state_dict(state["opt"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.log, self.evals, self.wall_s = state["log"], state["evals"], state["wall_s"]
        return True

    def export(self) -> Path:
        """The adapter directory ``OUT/adapter`` (bf16 tensors), the JSON log and the curve."""
        from .trainer import plot_loss

        meta = {
            "data": self.data_info,
            "step": self.step,
            "total_steps": self.total_steps,
            "wall_s": round(self.wall_s, 1),
            "heldout": self.evals[-1] if self.evals else None,
            "config": asdict(self.cfg),
        }
        (self.out / "train_log.json").write_text(dumps(dict(meta, train=self.log, evals=self.evals), indent=1))
        path = save_mask_adapter(
            self.model,
            self.out / "adapter",
            base_name=self.base_name,
            base_fingerprint=self.base_fingerprint,
            meta=meta,
        )
        evals = [
            {"step": e["step"], **{f"bs{b}": {"nats_per_token": e[f"bs{b}"]} for b in self.cfg.eval_block_sizes}}
            for e in self.evals
        ]
        try:
            plot_loss(self.log, evals, path / "loss_curve.png", title=f"mask adapter on {self.base_name}")
        except ImportError:
            pass
        return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m dspec.train.mask_adapter",
        description="Train a mask-selective block-diffusion adapter on a causal LM.",
    )
    ap.add_argument("--base", default="smollm2-135m", help="shipped causal model or checkpoint dir")
    ap.add_argument(
        "--data",
        required=True,
        help="data-engine directories (python -m dspec.train.data_engine), comma-separated: read back "
        "to back; DIR:N reads its first N shards, DIR:A-B shards A <= i < B",
    )
    ap.add_argument("--out", required=True, help="run directory (checkpoint.pt, train_log.json, adapter/)")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (fixes the schedule length)")
    ap.add_argument("--max-steps", type=int, default=None)
    d = MaskAdapterConfig()
    ap.add_argument("--rank", type=int, default=d.rank, help="LoRA rank (default %(default)s)")
    ap.add_argument(
        "--block-sizes",
        default=",".join(map(str, d.block_sizes)),
        help="block sizes drawn per step (default %(default)s)",
    )
    ap.add_argument(
        "--block-weights",
        default=None,
        help="their sampling weights, comma-separated (default %s for the default sizes, else "
        "uniform)" % ",".join(map(str, d.block_weights)),
    )
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    ap.add_argument(
        "--mask-token", default=d.mask_token, help="an unused token string used as [MASK] (default %(default)s)"
    )
    ap.add_argument("--autocast", choices=("auto", "bf16", "none"), default=d.autocast)
    ap.add_argument(
        "--distill",
        type=float,
        default=d.distill,
        help="weight in [0, 1] of the KL to the base model's next-token distribution (default %(default)s)",
    )
    ap.add_argument("--threads", default=None, help="torch threads (default: dspec's policy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--heldout-start",
        type=int,
        default=0,
        help="hold out only sequences from this index on: a later round on a data directory resumed "
        "to more tokens passes the earlier sequence count (default %(default)s)",
    )
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    ap.add_argument(
        "--init",
        default=None,
        help="warm start: an adapter directory or a shipped adapted name (smollm2-135m-bd) with the same "
        "targets and a rank <= --rank (a lower rank fills the leading slice: the same function at "
        "step 0); a new schedule starts from its weights",
    )
    args = ap.parse_args(argv)
    from ..cpu import apply_threads
    from ..hub import load
    from .data_engine import read_directories
    from .lora import base_fingerprint

    out = Path(args.out)
    # the checkpoint to continue is read (and checked) before any work; it never runs code
    ckpt = out / "checkpoint.pt"
    resume_state = read_checkpoint(ckpt) if args.resume and ckpt.is_file() else None
    apply_threads(args.threads)
    try:
        sizes = tuple(int(b) for b in args.block_sizes.split(","))
        if args.block_weights is not None:
            weights = tuple(float(w) for w in args.block_weights.split(","))
        else:
            weights = d.block_weights if sizes == d.block_sizes else (1.0,) * len(sizes)
        cfg = MaskAdapterConfig(
            rank=args.rank,
            block_sizes=sizes,
            block_weights=weights,
            batch_size=args.batch_size,
            lr=args.lr,
            mask_token=args.mask_token,
            autocast=args.autocast,
            seed=args.seed,
            heldout_start=args.heldout_start,
            distill=args.distill,
            eval_block_sizes=tuple(b for b in (2, 4, 8) if b <= max(sizes)) or (max(sizes),),
        )
        sequences, data_info = read_directories(args.data.split(","))
    except ValueError as e:
        ap.error(str(e))
    if (out / "checkpoint.pt").exists() and not args.resume:
        ap.error(f"{out / 'checkpoint.pt'} exists: pass --resume to continue or choose another --out")
    base = load(args.base, dtype="float32")
    mask_id = base.tokenizer.token_to_id(cfg.mask_token) if base.tokenizer is not None else None
    if mask_id is None:
        ap.error(f"--mask-token: {cfg.mask_token!r} is not a token of {args.base}")
    fingerprint = base_fingerprint(base)
    model = mask_diffusion_model(
        base,
        block_size=cfg.block_size,
        mask_token_id=mask_id,
        rank=cfg.rank,
        alpha=cfg.alpha,
        targets=cfg.targets,
        seed=cfg.seed,
    )
    del base
    if args.init and resume_state is None:
        from ..hub import ADAPTED, adapter_dir

        try:
            init_mask_adapter(model, adapter_dir(args.init) if args.init in ADAPTED else args.init)
        except ValueError as e:
            ap.error(f"--init: {e}")
    info = dict(data_info, init=args.init) if args.init else data_info
    try:
        trainer = MaskAdapterTrainer(
            model, sequences, cfg, out, base_name=str(args.base), base_fingerprint=fingerprint, data_info=info
        )
    except ValueError as e:
        ap.error(str(e))
    if resume_state is not None:
        trainer.resume(resume_state)
        del resume_state
    result = trainer.train(minutes=args.minutes, max_steps=args.max_steps)
    result["adapter"] = str(out / "adapter")
    print(dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))

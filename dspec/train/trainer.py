"""The training loop: one code path for a tiny model on a CPU and a real one on a GPU.

- AdamW (decoupled weight decay on matrices only), linear warmup then cosine decay to
  ``min_lr``; gradient clipping; gradient accumulation over micro-batches;
- bf16 autocast on CUDA (``autocast="auto"``), float32 on CPU;
- a time budget (``minutes``): the first call measures its step time after a few steps and
  fixes the schedule's total length so the cosine ends within the budget; the length is
  stored in the checkpoint, so ``resume`` continues the same schedule;
- resumable checkpoints (model, optimizer, step, schedule, log) written atomically every
  ``checkpoint_every_s`` seconds and at the end.  Batches come from
  ``PackedData.batch(step)`` and the diffusion noise / block size from generators seeded by
  ``(seed, step)``, so a run interrupted and resumed gives the weights of an uninterrupted
  run (same device, dtype and thread count);
- tqdm progress, a JSON log (train loss, learning rate, tokens, held-out losses) and a
  matplotlib loss curve.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._cli import dumps
from ..models.transformer import Model
from .data import PackedData
from .loop import fit_length
from .objectives import block_diffusion_batch, block_diffusion_loss, causal_lm_loss

OBJECTIVES = ("causal", "block_diffusion")
CHECKPOINT = "checkpoint.pt"
LOG_JSON = "train_log.json"
LOSS_PNG = "loss_curve.png"

__all__ = ["TrainConfig", "Trainer", "lr_at", "OBJECTIVES"]


@dataclass
class TrainConfig:
    """Optimisation settings.

    objective : "causal" (next-token) or "block_diffusion" (masked denoising, 2L layout).
    batch_size : rows per optimizer step; micro_batch_size : rows per forward (gradient
        accumulation when smaller; None = batch_size).
    lr, min_lr, warmup_steps, max_steps : schedule (linear warmup, cosine to min_lr at the
        total step count: max_steps, or fewer when a time budget fixes it).
    block_sizes, block_weights : block-diffusion block size drawn per optimizer step.
    weighting : block-diffusion loss weighting, "mean" or "elbo" (see objectives).
    shifted : right-shifted block diffusion (Fast-dLLM v2 style).
    eval_every : steps between held-out evaluations (0: only at the end).
    checkpoint_every_s : seconds between checkpoints.
    autocast : "auto" (bf16 on CUDA, none on CPU), "bf16" or "none".
    """

    objective: str = "causal"
    batch_size: int = 32
    micro_batch_size: int | None = None
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    max_steps: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    block_sizes: tuple = (1, 2, 4, 8, 16)
    block_weights: tuple | None = None
    eval_block_sizes: tuple = (1, 4, 8)
    weighting: str = "mean"
    shifted: bool = False
    eval_every: int = 200
    log_every: int = 10
    checkpoint_every_s: float = 120.0
    autocast: str = "auto"
    seed: int = 0

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        for name in ("batch_size", "max_steps", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        mb = self.micro_batch_size
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1 or self.batch_size % mb):
            raise ValueError(f"micro_batch_size must divide batch_size {self.batch_size}, got {mb!r}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ValueError("warmup_steps and eval_every must be >= 0")
        if self.weighting not in ("mean", "elbo"):
            raise ValueError(f"weighting must be 'mean' or 'elbo', got {self.weighting!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be 'auto', 'bf16' or 'none', got {self.autocast!r}")
        self.block_sizes = tuple(int(b) for b in self.block_sizes)
        if not self.block_sizes or min(self.block_sizes) < 1:
            raise ValueError(f"block_sizes must be ints >= 1, got {self.block_sizes!r}")
        if self.block_weights is not None:
            self.block_weights = tuple(float(w) for w in self.block_weights)
            if (
                len(self.block_weights) != len(self.block_sizes)
                or min(self.block_weights) < 0
                or sum(self.block_weights) <= 0
            ):
                raise ValueError("block_weights must be one weight >= 0 per block size, not all 0")
        self.eval_block_sizes = tuple(int(b) for b in self.eval_block_sizes)


CHECKPOINT_KEYS = ("model", "optimizer", "step", "total_steps", "tokens_seen", "wall_s", "log", "evals")


def read_checkpoint(path, *, map_location="cpu") -> dict:
    """A :class:`Trainer`'s checkpoint.pt, read without running code from it
    (:func:`dspec.train.state_files.load_state`); ValueError when it is not one."""
    from .state_files import load_state

    return load_state(path, "resume: checkpoint.pt", keys=CHECKPOINT_KEYS, map_location=map_location)


def lr_at(step: int, cfg, total_steps: int | None) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` at ``total_steps`` (None:
    ``cfg.max_steps``).  The one schedule of every dspec trainer: ``cfg`` is any config with
    ``lr``, ``min_lr``, ``warmup_steps`` and ``max_steps`` (TrainConfig, the drafter's and the
    mask adapter's)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    total = total_steps or cfg.max_steps
    span = max(total - cfg.warmup_steps, 1)
    frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


class Trainer:
    """Train ``model`` on ``data`` with ``cfg``, checkpointing into ``out_dir``.

    Parameters
    ----------
    model : ``dspec.models.Model`` (float32 weights; moved to ``device``).
    data : ``PackedData`` (train rows + held-out rows per source).
    cfg : TrainConfig.
    out_dir : directory for checkpoint.pt, train_log.json, loss_curve.png and the export.
    device : "cpu", "cuda", ...
    mask_token_id : required for the block-diffusion objective.
    byte_lengths : [V] float UTF-8 bytes per token id (held-out bits/byte); optional.
    export : optional callable ``export(model, trainer)`` run after each checkpoint (e.g.
        writing a Hugging Face checkpoint directory).
    plot : write loss_curve.png with each checkpoint (matplotlib).

    On a CPU shared with other processes, ``torch.set_num_threads(1)`` is often fastest:
    spinning OpenMP threads that are descheduled cost more than they give.
    """

    def __init__(
        self,
        model: Model,
        data: PackedData,
        cfg: TrainConfig,
        out_dir,
        *,
        device="cpu",
        mask_token_id: int | None = None,
        byte_lengths: torch.Tensor | None = None,
        export=None,
        meta: dict | None = None,
        plot: bool = True,
    ):
        if not isinstance(model, Model):
            raise ValueError(f"model must be a dspec Model, got {type(model).__name__}")
        if not isinstance(data, PackedData):
            raise ValueError(f"data must be PackedData, got {type(data).__name__}")
        if cfg.objective == "block_diffusion" and mask_token_id is None:
            raise ValueError("mask_token_id is required for the block_diffusion objective")
        if cfg.batch_size > data.train.shape[0]:
            raise ValueError(f"cfg.batch_size {cfg.batch_size} exceeds the {data.train.shape[0]} training rows")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.requires_grad_(True)
        self.model.train()
        self.data = data
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.mask_token_id = mask_token_id
        self.byte_lengths = byte_lengths
        self.export = export
        self.meta = dict(meta or {})
        self.plot = plot
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=1e-8,
        )
        self.step = 0
        self.total_steps: int | None = None
        self.tokens_seen = 0
        self.wall_s = 0.0
        self.log: list[dict] = []
        self.evals: list[dict] = []

    # ------------------------------------------------------------------ checkpointing

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "wall_s": self.wall_s,
            "log": self.log,
            "evals": self.evals,
            "cfg": asdict(self.cfg),
            "meta": self.meta,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.total_steps = state["total_steps"]
        self.tokens_seen = int(state["tokens_seen"])
        self.wall_s = float(state["wall_s"])
        self.log = list(state["log"])
        self.evals = list(state["evals"])
        self.meta.update(state.get("meta", {}))

    def save(self) -> Path:
        """Write checkpoint.pt (atomically), the JSON log, the loss curve and the export."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, self.checkpoint_path)
        self.write_log()
        if self.export is not None:
            self.export(self.model, self)
        return self.checkpoint_path

    def resume(self, state: dict | None = None) -> bool:
        """Load checkpoint.pt from ``out_dir`` when it exists (or ``state``, read earlier by
        :func:`read_checkpoint`); True when it did."""
        if state is None:
            if not self.checkpoint_path.is_file():
                return False
            state = read_checkpoint(self.checkpoint_path, map_location=self.device)
        self.load_state_dict(state)
        return True

    def write_log(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = {
            "config": asdict(self.cfg),
            "meta": self.meta,
            "step": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "wall_s": round(self.wall_s, 1),
            "train": self.log,
            "heldout": self.evals,
        }
        (self.out_dir / LOG_JSON).write_text(dumps(summary, indent=1) + "\n")
        if not self.plot:
            return
        try:
            plot_loss(self.log, self.evals, self.out_dir / LOSS_PNG, title=self.meta.get("name", self.cfg.objective))
        except ImportError:  # matplotlib is optional
            pass

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        use = self.cfg.autocast == "bf16" or (self.cfg.autocast == "auto" and self.device.type == "cuda")
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use)

    def _step_generator(self, step: int, salt: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed((self.cfg.seed * 1_000_003 + step) * 7 + salt)
        return g

    def block_size_at(self, step: int) -> int:
        """The block size of optimizer step ``step`` (block diffusion)."""
        sizes = self.cfg.block_sizes
        if len(sizes) == 1:
            return sizes[0]
        w = torch.tensor(self.cfg.block_weights or [1.0] * len(sizes))
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return sizes[int(torch.multinomial(w, 1, generator=g))]

    def _loss(self, rows: torch.Tensor, step: int, gen: torch.Generator):
        if self.cfg.objective == "causal":
            return causal_lm_loss(self.model, rows)
        return block_diffusion_loss(
            self.model,
            rows,
            self.block_size_at(step),
            self.mask_token_id,
            generator=gen,
            weighting=self.cfg.weighting,
            shifted=self.cfg.shifted,
        )

    def train_step(self) -> float:
        """One optimizer step (with accumulation); returns the step's mean loss."""
        cfg = self.cfg
        rows = self.data.batch(self.step, cfg.batch_size).to(self.device)
        micro = cfg.micro_batch_size or cfg.batch_size
        lr = lr_at(self.step, cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        gen = self._step_generator(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        chunks = rows.split(micro)
        for chunk in chunks:
            with self._autocast():
                out = self._loss(chunk, self.step, gen)
            (out.loss / len(chunks)).backward()
            total += float(out.loss.detach()) / len(chunks)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        factor = 2 if cfg.objective == "block_diffusion" else 1  # the 2L layout
        self.tokens_seen += rows.numel() * factor
        return total

    @torch.no_grad()
    def evaluate(self, *, max_rows: int | None = None) -> dict:
        """Held-out losses per source: ``nats_per_token`` and ``bits_per_byte`` of the
        causal loss, or of block diffusion at each of ``eval_block_sizes`` (block size 1 is
        the exact autoregressive likelihood; larger sizes the mean masked-token loss under
        a fixed noise draw)."""
        self.model.eval()
        out = {"step": self.step, "tokens_seen": self.tokens_seen}
        try:
            for source, rows in self.data.heldout.items():
                rows = rows[:max_rows].long().to(self.device) if max_rows else rows.long().to(self.device)
                sizes = [None] if self.cfg.objective == "causal" else list(self.cfg.eval_block_sizes)
                for bs in sizes:
                    nll, count, nbytes = 0.0, 0.0, 0.0
                    gen = self._step_generator(0, salt=bs or 0)
                    for chunk in rows.split(self.cfg.micro_batch_size or self.cfg.batch_size):
                        with self._autocast():
                            if bs is None:
                                r = causal_lm_loss(self.model, chunk)
                                predicted = chunk[:, 1:]
                                weights = torch.ones_like(predicted, dtype=torch.float32)
                            else:
                                b = block_diffusion_batch(chunk, bs, self.mask_token_id, generator=gen)
                                r = block_diffusion_loss(
                                    self.model, chunk, bs, self.mask_token_id, batch=b, shifted=self.cfg.shifted
                                )
                                predicted = chunk
                                weights = b.masked.float()
                        nll += float(r.nll_sum)
                        count += float(r.count)
                        if self.byte_lengths is not None:
                            bl = self.byte_lengths.to(self.device)[predicted]
                            if bs is not None and self.cfg.shifted:
                                bl, weights = bl[:, 1:], weights[:, 1:]
                            nbytes += float((bl * weights).sum())
                    key = source if bs is None else f"{source}/bs{bs}"
                    out[key] = {"nats_per_token": nll / max(count, 1.0)}
                    if nbytes and (bs is None or bs == 1):  # an exact likelihood only then
                        out[key]["bits_per_byte"] = nll / math.log(2) / nbytes
        finally:
            self.model.train()
        return out

    def train(self, *, minutes: float | None = None, max_steps: int | None = None, progress: bool = True) -> dict:
        """Run until ``max_steps`` (default cfg.max_steps / the fixed schedule length) or
        until ``minutes`` of wall time in this call; checkpoint and evaluate at the end.
        Returns the final held-out evaluation."""
        cfg = self.cfg
        if minutes is not None and not minutes > 0:
            raise ValueError(f"minutes must be > 0, got {minutes!r}")
        if self.total_steps is None and minutes is None:
            self.total_steps = cfg.max_steps  # max_steps only stops this call early
        start = time.perf_counter()
        last_ckpt = start
        calib_from, calib_t, per_step, timed = None, None, None, False
        window: list[float] = []  # losses since the last log record
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=self.total_steps or cfg.max_steps,
                initial=self.step,
                desc=self.meta.get("name", "train"),
                unit="step",
                dynamic_ncols=True,
            )
        try:
            while True:
                limit = self.total_steps or cfg.max_steps
                if max_steps is not None:
                    limit = min(limit, max_steps)
                if self.step >= limit:
                    break
                t0 = time.perf_counter()
                loss = self.train_step()
                now = time.perf_counter()
                self.wall_s += now - t0
                # time budget: fit the schedule length to the measured step time, first after
                # a few steps, then every log_every steps from a running mean (a shared CPU's
                # speed drifts); a schedule fixed by an earlier call is kept
                if timed or self.total_steps is None:
                    if calib_from is None:
                        calib_from, calib_t = self.step, now
                    elif self.step - calib_from >= 5 and (self.total_steps is None or self.step % cfg.log_every == 0):
                        step_s = (now - calib_t) / (self.step - calib_from)
                        per_step = step_s if per_step is None else 0.7 * per_step + 0.3 * step_s
                        calib_from, calib_t = self.step, now
                        left = minutes * 60 - (now - start)
                        self.total_steps = fit_length(self.step, left, per_step, cfg.max_steps, 0.95)
                        timed = True
                        if bar is not None:
                            bar.total = self.total_steps
                            bar.refresh()
                window.append(loss)
                if self.step % cfg.log_every == 0 or self.step == 1:
                    self.log.append(
                        {
                            "step": self.step,
                            "loss": round(sum(window) / len(window), 5),
                            "lr": lr_at(self.step - 1, cfg, self.total_steps),
                            "tokens_seen": self.tokens_seen,
                            "wall_s": round(self.wall_s, 2),
                        }
                    )
                    window.clear()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}")
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self.evals.append(self.evaluate())
                if now - last_ckpt >= cfg.checkpoint_every_s:
                    self.save()
                    last_ckpt = time.perf_counter()
                if minutes is not None and now - start >= minutes * 60:
                    break
        finally:
            if bar is not None:
                bar.close()
        final = self.evaluate()
        if not self.evals or self.evals[-1]["step"] != self.step:
            self.evals.append(final)
        self.save()
        return final


def plot_loss(log: list[dict], evals: list[dict], path, *, title: str = "") -> None:
    """Training loss (and held-out losses) against optimizer steps, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if log:
        steps, losses = [r["step"] for r in log], [r["loss"] for r in log]
        ax.plot(steps, losses, lw=0.6, alpha=0.35, color="C0", label="train loss (logged)")
        if len(losses) >= 10:  # rows come from one source each: smooth the per-source swings
            k = max(len(losses) // 20, 5)
            smooth = [
                sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax.plot(steps, smooth, lw=1.6, color="C0", label=f"train loss ({k}-record mean)")
    keys = sorted({k for e in evals for k in e if isinstance(e[k], dict)})
    for k in keys:
        pts = [(e["step"], e[k]["nats_per_token"]) for e in evals if k in e]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, label=f"held-out {k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / predicted token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

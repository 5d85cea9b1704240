"""Training low-rank adapters (LoRA) for dspec's ``Model``: train a few MB, ship a few MB.

The adapter layers, merging and files live in :mod:`dspec.models.lora` (loading a shipped
adapter needs no trainer); their names are re-exported here.
"""

from __future__ import annotations

import torch

from ..models.lora import (  # noqa: F401
    ADAPTER_CONFIG,
    ADAPTER_FORMAT,
    ADAPTER_WEIGHTS,
    TARGETS,
    LoraConfig,
    LoraLinear,
    RowAdaptedEmbedding,
    apply_lora,
    base_fingerprint,
    is_adapted,
    load_adapter,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    mark_trainable,
    merge_lora,
    read_adapter_config,
    save_adapter,
)
from ..models.transformer import Model
from .trainer import Trainer

__all__ = [
    "LoraConfig",
    "LoraLinear",
    "RowAdaptedEmbedding",
    "apply_lora",
    "lora_parameters",
    "lora_state_dict",
    "load_lora_state_dict",
    "mark_trainable",
    "is_adapted",
    "AdapterTrainer",
    "merge_lora",
    "base_fingerprint",
    "save_adapter",
    "load_adapter",
    "read_adapter_config",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "TARGETS",
]


class AdapterTrainer(Trainer):
    """A :class:`~dspec.train.trainer.Trainer` that optimises only the adapter tensors and
    checkpoints only them (with their AdamW state): a SmolLM2 rank-16 checkpoint.pt is
    ~30 MB instead of ~1.6 GB, so it can travel between GPU calls.  The frozen base is
    rebuilt from its source on resume."""

    def __init__(self, model: Model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        params = mark_trainable(self.model)
        if not params:
            raise ValueError("model has no adapters (apply_lora first)")
        cfg = self.cfg
        decay = [p for p in params if p.dim() >= 2 and p is not getattr(self.model.embed_tokens, "rows", None)]
        no_decay = [p for p in params if not any(p is q for q in decay)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=1e-8,
        )

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["model"] = {n: t.clone() for n, t in lora_state_dict(self.model).items()}
        state["base_fingerprint"] = base_fingerprint(self.model)
        return state

    def load_state_dict(self, state: dict) -> None:
        want = state.get("base_fingerprint")
        if want is not None and want != base_fingerprint(self.model):
            raise ValueError("resume: checkpoint.pt was trained on other base weights than this model's")
        load_lora_state_dict(self.model, state["model"])
        rest = dict(state, model=self.model.state_dict())
        super().load_state_dict(rest)

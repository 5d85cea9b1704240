"""``dspec.train``: recipes that produce dspec's own models (tiny-ar, tiny-bd, adapted
block-diffusion drafters).

The same code trains a tiny model on a CPU and a real one on a GPU::

    python -m dspec.train tiny-bd --out runs/tiny-bd --minutes 18
    python -m dspec.train bd-adapt --init tiny-ar --out runs/ar-bd --device cuda --minutes 30

Modules: ``tokenizer`` (the shared byte-level BPE), ``data`` (sources, mixture, held-out
split, packed rows), ``objectives`` (causal LM loss, 2L block-diffusion loss, a fast
training forward equal to ``Model.forward``), ``trainer`` (the loop, checkpoints, logs),
``recipes`` (named recipes and :func:`run_recipe`).
"""

from .data import SOURCES, DataSpec, PackedData, build_data, documents, is_heldout_problem, pack_rows
from .objectives import (
    block_diffusion_batch,
    block_diffusion_loss,
    block_diffusion_mask,
    causal_lm_loss,
    causal_mask,
    train_forward,
)
from .recipes import RECIPES, Recipe, export_checkpoint, get_recipe, run_recipe, tiny_config
from .tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from .trainer import TrainConfig, Trainer, lr_at

__all__ = [
    "SOURCES",
    "DataSpec",
    "PackedData",
    "build_data",
    "documents",
    "is_heldout_problem",
    "pack_rows",
    "block_diffusion_batch",
    "block_diffusion_loss",
    "block_diffusion_mask",
    "causal_lm_loss",
    "causal_mask",
    "train_forward",
    "RECIPES",
    "Recipe",
    "export_checkpoint",
    "get_recipe",
    "run_recipe",
    "tiny_config",
    "EOS_TOKEN",
    "MASK_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "save_tokenizer",
    "train_tokenizer",
    "TrainConfig",
    "Trainer",
    "lr_at",
]

"""Named training recipes: ``tiny-ar``, ``tiny-bd`` and ``bd-adapt``.

- ``tiny-ar``: a Qwen3-architecture causal LM (4 layers, d 256, GQA 4/2 heads, SwiGLU 768,
  tied embeddings, ~3.7M parameters) trained from scratch with next-token loss.
- ``tiny-bd``: the same architecture as an SDAR block-diffusion model (family "sdar":
  block-causal across blocks, bidirectional masked denoising within one, position-aligned
  logits, ``<|MASK|>``), trained from scratch with the 2L masked-denoising objective and a
  block size drawn per step from {1, 2, 4, 8, 16} so one model decodes at every block size
  up to 16 (block size 1 = autoregressive with [MASK] queries).
- ``bd-adapt``: DiffuSpec's drafter recipe / SmolLM2's block-diffusion adaptation: start from a causal
  checkpoint (``--init``: a directory or a shipped name such as ``tiny-ar`` or
  ``smollm2-135m``) and fine-tune it with the block-diffusion objective.  A Qwen3 source
  becomes an SDAR model (position-aligned); a Llama / Qwen2 source becomes a Fast-dLLM v2
  model (right-shifted logits, zero q/k/v biases, so step 0 computes exactly the source's
  next-token logits).  Full fine-tuning by default; ``lora_rank=R`` (``--lora-rank R``)
  trains low-rank adapters on every projection plus the [MASK] embedding row instead and
  exports only them (``<out>/adapter``, see :mod:`dspec.train.lora`), loaded on top of
  the source by :func:`load_adapted` (how ``dspec.load("smollm2-135m-bd")`` is built).

The two tiny recipes fit the same byte-level BPE tokenizer (deterministic, 4096 ids: EOS 0,
MASK 1, PAD 2) on the same corpus, so ``tiny-bd`` can draft for ``tiny-ar``.

:func:`run_recipe` does everything: tokenizer, tokenised data (cached in the output
directory), model, training with checkpoints, and an exported Hugging Face checkpoint
directory (``<out>/model``) that ``dspec.load`` reads.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .._cli import dumps
from ..models.adapters import adapt_causal_model, load_adapted, resolve_source
from ..models.config import FAMILIES, parse_config
from ..models.loader import checkpoint_names
from ..models.transformer import Model
from .data import DataSpec, PackedData, build_data, token_byte_lengths, tokenizer_corpus
from .tokenizer import MASK_TOKEN, save_tokenizer, train_tokenizer
from .trainer import TrainConfig, Trainer, read_checkpoint

__all__ = [
    "Recipe",
    "RECIPES",
    "get_recipe",
    "run_recipe",
    "tiny_config",
    "export_checkpoint",
    "adapt_causal_model",
    "load_adapted",
]


@dataclass(frozen=True)
class Recipe:
    """A named way to make a model.

    family : the exported family ("qwen3", "llama", "sdar", ...; for ``init`` recipes it is
        derived from the source).
    model : architecture keys (config.json names) for a model trained from scratch.
    data, train : DataSpec and TrainConfig.
    vocab_size : size of the fitted tokenizer (from-scratch recipes).
    block_size : default block size written to config.json (block-diffusion families).
    minutes : default time budget of ``python -m dspec.train``.
    num_rows : packed training rows to prepare (enough for the budget; reused cyclically).
    export_dtype : dtype of the exported weights.
    init_required : the recipe adapts an existing checkpoint (``init=``).
    """

    name: str
    description: str
    family: str
    model: dict
    data: DataSpec
    train: TrainConfig
    vocab_size: int = 4096
    block_size: int | None = None
    minutes: float | None = 40.0
    num_rows: int = 40_000
    export_dtype: str = "bfloat16"
    init_required: bool = False


TINY_MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY_MIX = {"stdlib": 0.3, "sharegpt": 0.25, "arithmetic": 0.45}

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "tiny-ar",
            "Qwen3-style causal LM, ~3.7M parameters, from scratch on CPU",
            family="qwen3",
            model=TINY_MODEL,
            data=DataSpec(weights=TINY_MIX, seq_len=256, max_chars=4_000_000),
            num_rows=12_000,
            train=TrainConfig(
                objective="causal",
                batch_size=6,
                lr=3e-3,
                min_lr=3e-4,
                warmup_steps=40,
                max_steps=20_000,
                eval_every=100,
                autocast="bf16",
            ),
        ),
        Recipe(
            "tiny-bd",
            "SDAR-style block-diffusion LM, ~3.7M parameters, from scratch on CPU",
            family="sdar",
            model=TINY_MODEL,
            block_size=8,
            data=DataSpec(weights=TINY_MIX, seq_len=128, max_chars=4_000_000),
            num_rows=12_000,
            train=TrainConfig(
                objective="block_diffusion",
                batch_size=8,
                lr=3e-3,
                min_lr=3e-4,
                warmup_steps=40,
                max_steps=20_000,
                eval_every=100,
                autocast="bf16",
                block_sizes=(1, 2, 4, 8, 16),
                block_weights=(0.2, 0.1, 0.25, 0.3, 0.15),
                eval_block_sizes=(1, 4, 8),
            ),
        ),
        Recipe(
            "bd-adapt",
            "adapt a causal checkpoint (--init) to block diffusion by fine-tuning",
            family="(from --init)",
            model={},
            block_size=4,
            init_required=True,
            data=DataSpec(weights=TINY_MIX, seq_len=256),
            train=TrainConfig(
                objective="block_diffusion",
                batch_size=16,
                lr=3e-4,
                min_lr=3e-5,
                warmup_steps=50,
                max_steps=20_000,
                eval_every=250,
                block_sizes=(1, 2, 4, 8),
                block_weights=(0.15, 0.2, 0.35, 0.3),
                eval_block_sizes=(1, 4),
            ),
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {sorted(RECIPES)}")
    return RECIPES[name]


# --------------------------------------------------------------------------- configs


def tiny_config(
    family: str,
    model: dict,
    *,
    vocab_size: int,
    eos_token_id: int,
    pad_token_id: int | None,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """A config.json (dict) for a from-scratch model of ``family`` with plain HF keys."""
    arch = {
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "llama": ("LlamaForCausalLM", "llama"),
        "sdar": ("SDARForCausalLM", "sdar"),
    }
    if family not in arch:
        raise ValueError(f"family must be one of {sorted(arch)} for a from-scratch model, got {family!r}")
    raw = {
        "architectures": [arch[family][0]],
        "model_type": arch[family][1],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        **model,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
    }
    if family in ("qwen3", "sdar"):
        raw.update(
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=model["num_hidden_layers"],
        )
    if family == "sdar":
        if mask_token_id is None or block_size is None:
            raise ValueError("an sdar config needs mask_token_id and block_size")
        raw.update(block_size=block_size, mask_token_id=mask_token_id)
    return raw


def export_checkpoint(
    model: Model, raw_config: dict, tokenizer_dir, out_dir, *, dtype: str = "bfloat16", extra_files: dict | None = None
) -> Path:
    """Write a Hugging Face checkpoint directory: config.json, generation_config.json,
    model.safetensors (``dtype``) and the tokenizer files; written to a temporary
    directory and renamed into place."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = parse_config(raw_config)
    names = checkpoint_names(cfg)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    state = {names[k]: v.detach().to("cpu", tdtype).contiguous() for k, v in model.state_dict().items()}
    raw = dict(raw_config, torch_dtype=dtype)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600
    (tmp / "config.json").write_text(dumps(raw, indent=2) + "\n")
    gen = {"eos_token_id": raw.get("eos_token_id"), "pad_token_id": raw.get("pad_token_id")}
    (tmp / "generation_config.json").write_text(dumps(gen, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / f
        if src.is_file():
            shutil.copy(src, tmp / f)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


# --------------------------------------------------------------------------- running


def load_packed_data(path) -> PackedData:
    """A run's ``data.pt`` (:meth:`PackedData.state`), read without running code from it."""
    from .state_files import load_state

    state = load_state(path, "data.pt", keys=("train", "train_source", "heldout"))
    if not (
        torch.is_tensor(state["train"])
        and torch.is_tensor(state["train_source"])
        and isinstance(state["heldout"], dict)
    ):
        raise ValueError(f"data.pt: {path} does not hold packed rows (train, train_source tensors and a heldout dict)")
    return PackedData(state["train"], state["train_source"], state["heldout"], int(state.get("seed", 0)))


def _tokenizer_dir(recipe: Recipe, out: Path, tokenizer, init_dir: Path | None, progress: bool) -> Path:
    tdir = out / "tokenizer"
    if tokenizer is not None:
        src = Path(tokenizer)
        if not (src / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {src} has no tokenizer.json")
        if src.resolve() != tdir.resolve():
            tdir.mkdir(parents=True, exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (src / f).is_file():
                    shutil.copy(src / f, tdir / f)
        return tdir
    if (tdir / "tokenizer.json").is_file():
        return tdir
    if init_dir is not None:
        return _tokenizer_dir(recipe, out, init_dir, None, progress)
    if progress:
        print(f"[{recipe.name}] fitting the byte-level BPE tokenizer ({recipe.vocab_size} ids)", flush=True)
    tok = train_tokenizer(tokenizer_corpus(), vocab_size=recipe.vocab_size)
    return save_tokenizer(tok, tdir)


def run_recipe(
    recipe,
    out,
    *,
    minutes: float | None = None,
    max_steps: int | None = None,
    device: str = "cpu",
    resume: bool = False,
    init=None,
    tokenizer=None,
    mask_token: str | None = None,
    num_rows: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    seed: int | None = None,
    train_overrides: dict | None = None,
    data_overrides: dict | None = None,
    plot: bool = True,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    lora_targets=None,
    lora_dropout: float = 0.0,
) -> dict:
    """Train ``recipe`` (a name or a Recipe) into ``out``; returns a summary dict.

    Parameters
    ----------
    out : output directory: ``tokenizer/``, ``data.pt`` (tokenised rows), ``checkpoint.pt``,
        ``train_log.json``, ``loss_curve.png``, ``model/`` (the exported checkpoint),
        ``summary.json``.
    minutes : wall-time budget of this call (default: the recipe's, unless ``max_steps``).
    max_steps : stop after this many optimizer steps in total.
    device : "cpu" or "cuda" (bf16 autocast there).
    resume : continue from ``out/checkpoint.pt`` (same schedule); without it an existing
        checkpoint is an error, so nothing is overwritten by accident.
    init : source checkpoint (directory or shipped name) for ``bd-adapt``.
    tokenizer : a directory with tokenizer.json to use instead of fitting one.
    mask_token : for ``bd-adapt`` when the source tokenizer has no ``<|MASK|>``: an
        existing (rarely used) token to serve as the mask.
    num_rows : packed training rows to prepare (default the recipe's).
    threads : torch.set_num_threads for this process (CPU).
    seed : data order / init / noise seed (default the recipe's).
    train_overrides : TrainConfig fields to change (e.g. {"batch_size": 64}).
    data_overrides : DataSpec fields to change (e.g. {"seq_len": 512}).
    plot : write loss_curve.png with each checkpoint.
    lora_rank : ``bd-adapt`` only: 0 = full fine-tuning (``<out>/model``); R > 0 = LoRA of
        rank R on ``lora_targets`` (default every projection) plus the [MASK] embedding
        row, checkpointing and exporting only those (``<out>/adapter``: adapter.safetensors
        in the recipe's export dtype + adapter_config.json; load with :func:`load_adapted`).
    lora_alpha, lora_dropout : LoRA scale numerator (default 2 R) and input dropout.
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    if recipe.init_required and init is None:
        raise ValueError(f"recipe {recipe.name!r} adapts a checkpoint: pass init= (a directory or shipped name)")
    if not recipe.init_required and init is not None:
        raise ValueError(f"recipe {recipe.name!r} trains from scratch and takes no init")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes must be > 0, got {minutes!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0, got {lora_rank!r}")
    if lora_rank and not recipe.init_required:
        raise ValueError(f"lora_rank: recipe {recipe.name!r} trains from scratch; LoRA needs an init= source")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    if threads is not None:
        torch.set_num_threads(int(threads))
    out = Path(out)
    ckpt = out / "checkpoint.pt"
    if ckpt.exists() and not resume:
        raise ValueError(f"{ckpt} exists: pass resume=True (--resume) to continue it, or another out")
    # read (and check) the checkpoint before any data or model work; it never runs code
    resume_state = read_checkpoint(ckpt) if resume and ckpt.is_file() else None
    out.mkdir(parents=True, exist_ok=True)
    if minutes is None and max_steps is None and not resume:
        minutes = recipe.minutes
    seed = recipe.data.seed if seed is None else int(seed)
    data_spec = dataclasses.replace(recipe.data, seed=seed, **(data_overrides or {}))
    tcfg = dataclasses.replace(recipe.train, seed=seed, **(train_overrides or {}))
    t_start = time.perf_counter()

    init_dir = resolve_source(init) if init is not None else None
    tdir = _tokenizer_dir(recipe, out, tokenizer, init_dir, progress)
    from ..models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tdir)

    # ---- model and its exported config
    if init_dir is not None:
        from ..models.loader import load_checkpoint

        src_model = load_checkpoint(init_dir, dtype=torch.float32)
        mask_id = tok.token_to_id(mask_token or MASK_TOKEN) if tok is not None else None
        if mask_id is None:
            raise ValueError(
                f"mask_token: the tokenizer of {init_dir} has no {mask_token or MASK_TOKEN!r}; "
                f"pass mask_token= an existing rarely used token to serve as [MASK]"
            )
        src_model.tokenizer = tok
        model, raw, family = adapt_causal_model(src_model, mask_token_id=mask_id, block_size=recipe.block_size)
        del src_model
        tcfg = dataclasses.replace(tcfg, shifted=FAMILIES[family].shifted)
    else:
        family = recipe.family
        mask_id = tok.mask_token_id if family == "sdar" else None
        raw = tiny_config(
            family,
            recipe.model,
            vocab_size=tok.vocab_size,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            mask_token_id=mask_id,
            block_size=recipe.block_size,
            dtype=recipe.export_dtype,
        )
        cfg = parse_config(raw)
        cfg = cfg.replace(mask_token_id=mask_id)
        model = Model(cfg, tokenizer=tok)
        model.init_random_(0.02, seed=seed)
        with torch.no_grad():  # GPT-2 residual scaling
            for layer in model.layers:
                layer.self_attn.o_proj.weight.mul_((2 * cfg.num_layers) ** -0.5)
                layer.mlp.down_proj.weight.mul_((2 * cfg.num_layers) ** -0.5)
    lora_cfg = None
    if lora_rank:
        from .lora import TARGETS, LoraConfig, apply_lora

        lora_cfg = LoraConfig(
            rank=lora_rank,
            alpha=lora_alpha,
            dropout=lora_dropout,
            targets=tuple(lora_targets or TARGETS),
            embedding_rows=(mask_id,),
        )
        apply_lora(model, lora_cfg)

    # ---- data (tokenised once per output directory)
    data_file = out / "data.pt"
    rows = num_rows or recipe.num_rows
    if data_file.is_file():
        data = load_packed_data(data_file)
    else:
        if progress:
            print(f"[{recipe.name}] tokenising the corpus into {rows} rows of {data_spec.seq_len}", flush=True)
        data = build_data(tok, data_spec, rows, eos_id=tok.eos_token_id, progress=progress)
        torch.save(data.state(), data_file)
    prep_s = time.perf_counter() - t_start

    n_params = sum(p.numel() for p in model.parameters())
    meta = {
        "name": recipe.name,
        "family": family,
        "parameters": n_params,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "init": str(init) if init is not None else None,
        "data": dataclasses.asdict(data_spec) | {"weights": dict(data_spec.weights)},
    }
    trainer_cls = Trainer
    if lora_cfg is not None:
        from .lora import AdapterTrainer, lora_parameters, save_adapter

        meta["lora"] = dataclasses.asdict(lora_cfg)
        meta["trainable_parameters"] = sum(p.numel() for p in lora_parameters(model).values())
        trainer_cls = AdapterTrainer
        bd_meta = {
            "family": family,
            "block_size": recipe.block_size,
            "mask_token_id": mask_id,
            "mask_token": tok.id_to_token(mask_id),
            "shifted": FAMILIES[family].shifted,
        }

        def export(m, trainer):
            save_adapter(
                out / "adapter",
                m,
                str(init),
                {
                    "block_diffusion": bd_meta,
                    "recipe": recipe.name,
                    "step": trainer.step,
                    "tokens_seen": trainer.tokens_seen,
                    "train_wall_s": round(trainer.wall_s, 1),
                    "heldout": trainer.evals[-1] if trainer.evals else None,
                },
                dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}.get(recipe.export_dtype, torch.float32),
            )
    else:

        def export(m, trainer):
            export_checkpoint(m, raw, tdir, out / "model", dtype=recipe.export_dtype)

    trainer = trainer_cls(
        model,
        data,
        tcfg,
        out,
        device=device,
        mask_token_id=mask_id,
        byte_lengths=token_byte_lengths(tok),
        export=export,
        meta=meta,
        plot=plot,
    )
    if resume_state is not None:
        trainer.resume(resume_state)
        del resume_state
    final = trainer.train(minutes=minutes, max_steps=max_steps, progress=progress)
    summary = {
        "recipe": recipe.name,
        "family": family,
        "parameters": n_params,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "tokens_seen": trainer.tokens_seen,
        "train_wall_s": round(trainer.wall_s, 1),
        "prep_s": round(prep_s, 1),
        "heldout": final,
        "model_dir": str(out / "model"),
    }
    if lora_cfg is not None:
        summary.pop("model_dir")
        summary.update(
            adapter_dir=str(out / "adapter"), lora_rank=lora_rank, trainable_parameters=meta["trainable_parameters"]
        )
    (out / "summary.json").write_text(dumps(summary, indent=2) + "\n")
    return summary

"""Low-rank adapters (LoRA) for dspec's ``Model``: the layers, merging and the adapter files
(training them: :mod:`dspec.train.lora`).

A LoRA linear computes ``y = x W^T + b + (alpha / r) * dropout(x) A^T B^T`` with the base
``W`` [out, in] frozen, ``A`` [r, in] (Kaiming-uniform init) and ``B`` [out, r] (zero
init), so an adapter that was just applied leaves the model exactly equal to its base.
:func:`merge_lora` folds ``(alpha / r) B A`` into ``W`` for inference: the merged model is
a plain ``Model`` with no runtime cost.

Beyond the low-rank matrices an adaptation may need a few full embedding rows: block
diffusion needs a trained ``[MASK]`` embedding.  ``LoraConfig.embedding_rows`` names token
ids whose embedding row is trained (fully, as an extra tensor of [k, hidden]).  With tied
embeddings the same row is the token's output row, and training, merging and inference all
see the one row: the adapted model is exactly the shipped one.

The vocabulary never grows.  A model without a mask token reuses an unused special token
as ``[MASK]`` (for SmolLM2, whose 49152 ids include StarCoder's repository markers,
``<filename>``, id 6, never seen in chat): its trained row is an extra tensor of the
adapter.  Appending a new id instead would change the tokenizer, the output matrix (49153
rows, tied to the input) and every downstream tokenizer comparison (drafters, n-gram
tables) for one row of parameters.

Files written by :func:`save_adapter`::

    <dir>/adapter_config.json     rank, alpha, targets, rows, base name + fingerprint, meta
    <dir>/adapter.safetensors     layers.{i}.{self_attn|mlp}.{proj}.lora_A / .lora_B,
                                  embed_tokens.rows  (float32 unless dtype= says otherwise)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .._cli import dumps
from .dense import dense
from .mask_adapter import init_low_rank
from .transformer import Model

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
    "merge_lora",
    "base_fingerprint",
    "save_adapter",
    "load_adapter",
    "read_adapter_config",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "TARGETS",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_FORMAT = "dspec-lora-1"
#: projection name -> its parent module attribute in a Block
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass
class LoraConfig:
    """What to adapt.

    rank : r >= 1, the inner dimension of ``B A``.
    alpha : scale numerator; the update is ``(alpha / rank) * B A`` (default 2 * rank).
    dropout : dropout on the adapter's input during training (0 disables it).
    targets : projections to adapt, a subset of q/k/v/o_proj, gate/up/down_proj.
    embedding_rows : token ids whose embedding row is trained in full (e.g. the [MASK]).
    """

    rank: int = 16
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    embedding_rows: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if self.alpha is None:
            self.alpha = 2.0 * self.rank
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            self.targets = (self.targets,)
        self.targets = tuple(self.targets)
        bad = [t for t in self.targets if t not in TARGETS]
        if not self.targets or bad:
            raise ValueError(f"targets must be a non-empty subset of {list(TARGETS)}, got {self.targets!r}")
        rows = tuple(int(r) for r in self.embedding_rows)
        if len(set(rows)) != len(rows) or any(r < 0 for r in rows):
            raise ValueError(f"embedding_rows must be distinct token ids >= 0, got {self.embedding_rows!r}")
        self.embedding_rows = rows

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight`` / ``bias``, frozen) plus ``lora_A`` [r, in] and
    ``lora_B`` [out, r]; forward ``dense(x, W, b) + scale * (drop(x) A^T) B^T``."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float):
        init_low_rank(self, base, rank, scale)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.weight, self.bias)
        h = self.dropout(x).to(self.lora_A.dtype)  # autocast still runs the matmuls in bf16
        return y + (F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scale).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """[out, in] float32: the update ``scale * B A`` that :func:`merge_lora` folds in."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.lora_A.shape[0]}, scale={self.scale:g}"
        )


class RowAdaptedEmbedding(nn.Module):
    """An embedding whose rows ``row_ids`` are replaced by the trainable ``rows`` [k, hidden].

    ``weight`` is a property: the frozen ``base_weight`` with those rows put in (one
    out-of-place copy per access), so ``Model.output_weight`` of a tied model sees the
    trained rows as well and the adapted model is exactly what :func:`merge_lora` ships.
    """

    def __init__(self, base: nn.Embedding, row_ids: tuple):
        super().__init__()
        if max(row_ids) >= base.num_embeddings:
            raise ValueError(
                f"embedding_rows: id {max(row_ids)} is outside the {base.num_embeddings}-row "
                f"embedding (the vocabulary does not grow: reuse an unused token id)"
            )
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.base_weight = base.weight
        self.base_weight.requires_grad_(False)
        self.register_buffer(
            "row_ids", torch.tensor(row_ids, dtype=torch.long, device=base.weight.device), persistent=False
        )
        self.rows = nn.Parameter(base.weight.detach()[self.row_ids].float().clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.base_weight.index_put((self.row_ids,), self.rows.to(self.base_weight.dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


def _check_model(model) -> None:
    if not isinstance(model, Model):
        raise ValueError(f"model must be a dspec Model, got {type(model).__name__}")


def _linears(model: Model):
    """(name, parent module, attribute, module) of every adaptable projection."""
    for i, layer in enumerate(model.layers):
        for proj, parent_name in TARGETS.items():
            parent = getattr(layer, parent_name)
            yield f"layers.{i}.{parent_name}.{proj}", parent, proj, getattr(parent, proj)


def is_adapted(model: Model) -> bool:
    return any(isinstance(m, (LoraLinear, RowAdaptedEmbedding)) for m in model.modules())


def apply_lora(model: Model, cfg: LoraConfig) -> Model:
    """Wrap ``cfg.targets`` of every layer with :class:`LoraLinear` (B = 0: the model's
    outputs are unchanged) and the embedding with :class:`RowAdaptedEmbedding` when
    ``cfg.embedding_rows`` is set; freeze everything else.  In place; returns ``model``.

    Only the adapter tensors (:func:`lora_parameters`) have ``requires_grad``.
    """
    _check_model(model)
    if not isinstance(cfg, LoraConfig):
        raise ValueError(f"cfg must be a LoraConfig, got {type(cfg).__name__}")
    if is_adapted(model):
        raise ValueError("model already has adapters: merge_lora it first")
    model.requires_grad_(False)
    for name, parent, proj, module in _linears(model):
        if proj in cfg.targets:
            setattr(parent, proj, LoraLinear(module, cfg.rank, cfg.scale, cfg.dropout))
    if cfg.embedding_rows:
        model.embed_tokens = RowAdaptedEmbedding(model.embed_tokens, cfg.embedding_rows)
    model.lora_config = cfg
    return model


def lora_parameters(model: Model) -> dict[str, nn.Parameter]:
    """name -> trainable adapter parameter (``...lora_A``, ``...lora_B``, ``embed_tokens.rows``)."""
    return {n: p for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")) or n == "embed_tokens.rows"}


def mark_trainable(model: Model) -> list[nn.Parameter]:
    """Freeze the base, unfreeze the adapter (undoes a ``model.requires_grad_(True)``)."""
    model.requires_grad_(False)
    params = list(lora_parameters(model).values())
    for p in params:
        p.requires_grad_(True)
    return params


def lora_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """The adapter tensors (detached, on their device) by name; what :func:`save_adapter` writes."""
    _check_model(model)
    state = {n: p.detach() for n, p in lora_parameters(model).items()}
    if not state:
        raise ValueError("model has no adapters (apply_lora first)")
    return state


def load_lora_state_dict(model: Model, state: dict) -> None:
    """Copy adapter tensors into an adapted ``model``; names and shapes must match exactly."""
    own = lora_parameters(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"adapter tensors do not match the model's adapters: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for n, p in own.items():
            if tuple(state[n].shape) != tuple(p.shape):
                raise ValueError(f"adapter tensor {n}: shape {tuple(state[n].shape)} != model's {tuple(p.shape)}")
            p.copy_(state[n].to(p.device, p.dtype))


@torch.no_grad()
def merge_lora(model: Model) -> Model:
    """Fold every adapter into the base weights and restore plain modules: afterwards the
    model is an ordinary ``Model`` (no adapter cost at inference).  In place."""
    _check_model(model)
    for name, parent, proj, module in _linears(model):
        if isinstance(module, LoraLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            w = module.weight
            w.copy_((w.float() + module.delta_weight()).to(w.dtype))
            plain.weight, plain.bias = w, module.bias
            setattr(parent, proj, plain)
    emb = model.embed_tokens
    if isinstance(emb, RowAdaptedEmbedding):
        w = emb.base_weight
        w[emb.row_ids] = emb.rows.to(w.dtype)
        plain = nn.Embedding(emb.num_embeddings, emb.embedding_dim, _weight=w)  # no init pass
        model.embed_tokens = plain
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def _base_tensors(model: Model):
    """(name, tensor) of the base weights in plain ``Model`` names, adapters left out."""
    for n, p in model.named_parameters():
        if n.endswith((".lora_A", ".lora_B")) or n == "embed_tokens.rows":
            continue
        if n == "embed_tokens.base_weight":
            n = "embed_tokens.weight"
        yield n, p


@torch.no_grad()
def base_fingerprint(model: Model, *, samples: int = 256) -> str:
    """A short hash of the base weights: names, shapes and ``samples`` strided values of
    each tensor rounded to bfloat16 (so a float32 and a bfloat16 load of one checkpoint
    agree).  Adapters (and the adapted embedding rows) are excluded."""
    _check_model(model)
    h = hashlib.sha256()
    for n, p in sorted(_base_tensors(model), key=lambda t: t[0]):
        flat = p.detach().reshape(-1)
        stride = max(flat.numel() // samples, 1)
        sample = flat[::stride][:samples].to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{n}:{tuple(p.shape)};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapter(
    out_dir, model: Model, base_name: str, meta: dict | None = None, *, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``adapter_config.json`` and ``adapter.safetensors`` to ``out_dir`` (atomic).

    Parameters
    ----------
    model : an adapted model (after :func:`apply_lora`, before :func:`merge_lora`).
    base_name : what the adapter goes on top of (a shipped name such as "smollm2-135m").
    meta : JSON-serialisable extras stored under "meta" (e.g. the block-diffusion config:
        family, block_size, mask token).
    dtype : dtype of the stored tensors (float32 default; bfloat16 halves the file).
    """
    from safetensors.torch import save_file

    _check_model(model)
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("model has no adapters (apply_lora first)")
    if not isinstance(base_name, str) or not base_name:
        raise ValueError(f"base_name must be a non-empty string, got {base_name!r}")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {n: t.to("cpu", dtype).contiguous() for n, t in lora_state_dict(model).items()}
    save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt", "dspec": ADAPTER_FORMAT})
    os.chmod(tmp / ADAPTER_WEIGHTS, 0o644)
    config = {
        "format": ADAPTER_FORMAT,
        "base_name": base_name,
        "base_fingerprint": base_fingerprint(model),
        "base_family": model.family,
        "lora": asdict(cfg),
        "num_tensors": len(state),
        "num_parameters": int(sum(t.numel() for t in state.values())),
        "meta": meta or {},
    }
    (tmp / ADAPTER_CONFIG).write_text(dumps(config, indent=2) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        os.replace(tmp / f, out_dir / f)
    tmp.rmdir()
    return out_dir


def read_adapter_config(adapter_dir) -> dict:
    """The parsed ``adapter_config.json`` of ``adapter_dir`` (ValueError when absent / bad)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file() or not (Path(adapter_dir) / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"adapter_dir: {adapter_dir} has no {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}")
    config = json.loads(path.read_text())
    if config.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"adapter_dir: {path} is not a {ADAPTER_FORMAT} adapter (format {config.get('format')!r})")
    return config


def load_adapter(model: Model, adapter_dir, *, merge: bool = False, check_fingerprint: bool = True) -> dict:
    """Apply the adapter in ``adapter_dir`` to the base ``model`` (in place).

    The base must be the one the adapter was trained on: same family (after any
    block-diffusion conversion) and the same weights, checked by :func:`base_fingerprint`.
    ``merge=True`` folds it in (:func:`merge_lora`).  Returns the adapter config.
    """
    from safetensors.torch import load_file

    _check_model(model)
    config = read_adapter_config(adapter_dir)
    if is_adapted(model):
        raise ValueError("model already has adapters: merge_lora it first")
    if config["base_family"] != model.family:
        raise ValueError(
            f"adapter {adapter_dir} was trained on a {config['base_family']!r} model, got a {model.family!r} one"
        )
    if check_fingerprint:
        got = base_fingerprint(model)
        if got != config["base_fingerprint"]:
            raise ValueError(
                f"adapter {adapter_dir} was trained on base {config['base_name']!r} with "
                f"fingerprint {config['base_fingerprint']}, but this model's weights have "
                f"fingerprint {got}: load the adapter on the base it was trained on"
            )
    lora = config["lora"]
    apply_lora(
        model,
        LoraConfig(
            rank=lora["rank"],
            alpha=lora["alpha"],
            dropout=lora["dropout"],
            targets=tuple(lora["targets"]),
            embedding_rows=tuple(lora["embedding_rows"]),
        ),
    )
    load_lora_state_dict(model, load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)))
    if merge:
        merge_lora(model)
    return config

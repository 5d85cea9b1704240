"""Every decoder layer of an inference forward in one ``dspec._C.decoder_layers`` call.

A decode step on the CPU runs ~15 small ops per layer (norms, grouped projections, RoPE,
attention, adds, SiLU); from Python each pays a dispatch comparable to its math at one
token.  ``run_layers`` hands the whole stack to C++ when the forward allows it (the CPU, no
autograd, a float32 / bfloat16 model of plain or mask-adapted projections, the C++
attention plan, the rows ``dense`` packs).  It runs the same kernels as the per-op
path in ``transformer.py`` with the same roundings, so the two are bit-identical (tested);
``None`` means the per-op path runs.

The per-model list of weight addresses (packed projections, norms, biases, adapter
matrices) is made once and reused while no weight changes (``_WeightTable``).  Checking
that costs a Python pass over every parameter (~270 for SmolLM2-135M, a few per cent of a
decode step), so a decode call that cannot change weights checks once for all its forwards
(:func:`frozen_weights`).

Threads: one model may decode from several Python threads at once.  The frozen scope's
depth counter and the table it holds are updated under one lock (the scope ends when the
last thread's scope ends), and a table keeps a reference to every tensor whose address it
holds, so a packed weight re-made by another thread never frees memory a forward reads.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .. import _backend, cpu
from .base import DecoderModel
from .dense import DTYPE_CODES, packed_weight, within_packed_rows
from .mask_adapter import MaskLoraLinear

__all__ = ["frozen_weights", "run_layers"]

#: False sends every forward through the per-op path (the tests compare the two)
ENABLED = True

_PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


class _WeightTable:
    """The addresses ``decoder_layers`` reads, for one model in one state of its weights."""

    __slots__ = ("key", "params", "weights", "lora", "lora_scales", "lora_rank", "lora_dtype", "lora_packed", "keep")

    def __init__(self, model):
        # every tensor whose address the table holds: a packed weight or adapter operand that
        # another thread re-makes (and re-attaches) stays alive while this table is in use
        self.keep = keep = []

        def address(t: torch.Tensor) -> int:
            keep.append(t)
            return t.data_ptr()

        modules = [_projections(layer) for layer in model.layers]
        self.params = [
            p
            for layer, mods in zip(model.layers, modules)
            for p in (
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                *(m.weight for m in mods),
                *(m.bias for m in mods if m.bias is not None),
            )
        ]
        self.key = params_state(self.params)
        self.weights = []
        for layer, mods in zip(model.layers, modules):
            self.weights += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
            self.weights += [address(packed_weight(m.weight)) for m in mods]
            self.weights += [0 if m.bias is None else m.bias.data_ptr() for m in mods]
        adapted = [m for mods in modules for m in mods if type(m) is MaskLoraLinear]
        self.lora, self.lora_scales, self.lora_rank, self.lora_dtype, self.lora_packed = [], [], 0, 0, []
        if adapted:
            self.params += [p for m in adapted for p in (m.lora_A, m.lora_B)]
            self.key = params_state(self.params)
            # one storage dtype for every adapter matrix: bf16 only when all of them are
            low = all(m.lora_operands()[0].dtype is torch.bfloat16 for m in adapted)
            self.lora_dtype = _backend.FLOAT_CODE[torch.bfloat16 if low else torch.float32]
            for mods in modules:
                for m in mods:
                    if type(m) is MaskLoraLinear:
                        a, bt = m.lora_operands(float32=not low)
                        self.lora += [address(a), address(bt)]
                        self.lora_scales.append(float(m.scale))
                        self.lora_rank = m.lora_A.shape[0]
                        packed = m.lora_packed() if low else None
                        self.lora_packed.append(0 if packed is None else address(packed))
                    else:
                        self.lora += [0, 0]
                        self.lora_scales.append(0.0)
                        self.lora_packed.append(0)


def _projections(layer) -> list[nn.Module]:
    """A layer's q, k, v, o, gate, up, down: under ``self_attn`` / ``mlp`` (the transformer's
    blocks), or the attention's directly on the layer (a DFlash drafter's layers)."""
    return [getattr(getattr(layer, part, layer), name) for part, name in _PROJECTIONS]


def params_state(params) -> tuple:
    """What invalidates a table: a parameter re-pointed or modified in place."""
    return tuple((p.data_ptr(), p._version) for p in params)


def _eligible(model) -> bool:
    """The model's layers are what decoder_layers computes (checked once per model)."""
    cfg = model.config
    if getattr(cfg, "qk_norm", False) or model.dtype not in DTYPE_CODES or model.device.type != "cpu":
        return False  # the C++ layers read host memory: a GPU model keeps the per-op path
    for layer in model.layers:
        for m in _projections(layer):
            if type(m) is not nn.Linear and type(m) is not MaskLoraLinear:
                return False
            if m.weight.dtype is not model.dtype or (m.bias is not None and m.bias.dtype is not model.dtype):
                return False
            if type(m) is MaskLoraLinear and not (m.lora_A.dtype is torch.float32 and m.lora_B.dtype is torch.float32):
                return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype is not model.dtype or not norm.weight.is_contiguous():
                return False
    return True


#: guards every model's ``_stack_frozen`` (depth, table) and the building of ``_stack_table``
_LOCK = threading.RLock()


def weight_table(model) -> _WeightTable | None:
    """The model's table of packed layer weights for ``decoder_layers``, built on first use
    and rebuilt when a parameter changes (:func:`params_state`); inside :func:`frozen_weights` the
    table taken on entry.  None where the layers are not what ``decoder_layers`` computes."""
    frozen = model.__dict__.get("_stack_frozen")
    if frozen is not None:
        return frozen[1]
    table = model.__dict__.get("_stack_table")
    if table is not None and params_state(table.params) == table.key:
        return table
    with _LOCK:
        table = model.__dict__.get("_stack_table")  # another thread may have built it meanwhile
        if table is not None and params_state(table.params) == table.key:
            return table
        if not _eligible(model):
            return None
        table = _WeightTable(model)
        model.__dict__["_stack_table"] = table
        return table


@contextlib.contextmanager
def frozen_weights(model):
    """A scope in which the weights of ``model`` (a dspec transformer) do not change, such as
    one decode call: the weight table is checked once on entry instead of once per forward.
    Nests, also across threads (scopes of several threads on one model share one table; the
    state goes when the last scope closes, whichever thread opened first); any other object
    passes through."""
    if not isinstance(model, DecoderModel):
        yield
        return
    with _LOCK:
        depth, table = model.__dict__.get("_stack_frozen") or (0, None)
        model.__dict__["_stack_frozen"] = (depth + 1, table if depth else weight_table(model))
    try:
        yield
    finally:
        with _LOCK:
            depth, table = model.__dict__["_stack_frozen"]
            if depth > 1:
                model.__dict__["_stack_frozen"] = (depth - 1, table)
            else:
                del model.__dict__["_stack_frozen"]


def run_layers(model, x, cos, sin, attention, layer_prefix, want, return_kv: bool):
    """The decoder layers in one call, or None when this forward cannot take that path.

    ``model``: a dspec transformer, or any module with ``layers`` of the same computation
    and a ``config`` naming its shape (a DFlash drafter).

    x [B, N, hidden] (updated in place: the caller passes a fresh tensor), cos / sin
    [B, N, 1, D] float32; ``attention`` the forward's ``CascadeAttentionPlan`` and
    ``layer_prefix(i)`` its layer-``i`` prefix.  Returns ``(x, kv, recorded)``: kv the
    suffix keys and values [2, layers, B, N, Hkv, D] (None without ``return_kv``),
    recorded {i: x after layer i} for i in ``want``.
    """
    ext = _backend.extension()
    meta = attention._meta
    if not ENABLED or meta is None or ext is None or not hasattr(ext, "decoder_layers") or x.dtype not in DTYPE_CODES:
        return None
    cfg = model.config
    batch, n, hidden = x.shape
    rows = batch * n
    if rows == 0 or not within_packed_rows(rows, x.dtype) or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if meta.prefix == 1:  # ragged rows gathered per layer: per-op path
        return None
    table = weight_table(model)
    if table is None:
        return None
    layers = cfg.num_layers
    d, hkv = cfg.head_dim, cfg.num_kv_heads
    if meta.prefix == 2:
        pk, pv = layer_prefix(0)
        item = pk.element_size()
        stride = 0
        if layers > 1:
            pk1, pv1 = layer_prefix(1)
            stride = (pk1.data_ptr() - pk.data_ptr()) // item
            if stride * item != pk1.data_ptr() - pk.data_ptr() or pv1.data_ptr() - pv.data_ptr() != stride * item:
                return None
        pks, pvs = pk.stride(), pv.stride()
        prefix = (
            pk.data_ptr(),
            pv.data_ptr(),
            pk.shape[0],
            pk.shape[1],
            pks[0],
            pks[1],
            pks[2],
            pvs[0],
            pvs[1],
            pvs[2],
            stride,
        )
    else:
        prefix = (0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)
    kv = torch.empty(2, layers, batch, n, hkv, d, dtype=x.dtype)
    slots = sorted(i for i in want if 0 < i < layers)
    record = [-1] * layers
    for s, i in enumerate(slots):
        record[i - 1] = s
    hid = torch.empty(len(slots), batch, n, hidden, dtype=x.dtype) if slots else None
    adapter = getattr(model, "mask_adapter", None)
    rows_index = adapter.rows.index if adapter is not None else None
    if rows_index is not None and (rows_index.dtype is not torch.int64 or not rows_index.is_contiguous()):
        return None
    mask_ptr, mask_s0, mask_s1 = meta.mask_part
    indptr, table_ptr, lens, indptr_code, max_pages, table_stride = meta.meta_part
    dt, _, _, hq, _, _, scale = meta.head
    ext.decoder_layers(
        x.data_ptr(),
        dt,
        batch,
        n,
        hidden,
        hq,
        hkv,
        d,
        cfg.intermediate_size,
        cfg.rms_norm_eps,
        cos.data_ptr(),
        sin.data_ptr(),
        mask_ptr,
        mask_s0,
        mask_s1,
        prefix[0],
        prefix[1],
        indptr,
        indptr_code,
        table_ptr,
        lens,
        prefix[2],
        prefix[3],
        max_pages,
        table_stride,
        *prefix[4:10],
        prefix[10],
        scale,
        table.weights,
        table.lora if rows_index is not None else [],
        table.lora_scales if rows_index is not None else [],
        table.lora_rank,
        0 if rows_index is None else rows_index.data_ptr(),
        0 if rows_index is None else rows_index.numel(),
        kv[0].data_ptr(),
        kv[1].data_ptr(),
        0 if hid is None else hid.data_ptr(),
        len(slots),
        record,
        cpu.kernel_threads(),
        table.lora_dtype if rows_index is not None else 0,
        table.lora_packed if rows_index is not None else [],
    )
    recorded = {i: hid[s] for s, i in enumerate(slots)}
    return x, kv if return_kv else None, recorded

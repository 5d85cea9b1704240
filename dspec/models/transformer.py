"""The lean transformer: Llama / Qwen2 / Qwen3 blocks that run attention plans.

One block: ``x += o_proj(attn(rope(q_norm?(q_proj(n1(x)))), rope(k_norm?(k_proj(.))),
v_proj(.)))``, then ``x += down(silu(gate(n2(x))) * up(n2(x)))``; RMSNorm in float32,
RoPE in float32 by absolute position (default / linear / llama3 frequencies), GQA, Qwen2's
q/k/v bias, Qwen3's per-head q/k RMSNorm, tied or separate output embedding.  Every layer's
attention is ``dspec.cascade_attention`` (planned once per forward: ``CascadeAttentionPlan``):
the suffix under the plan's packed mask plus the request's cached prefix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import _backend, _validate, cpu
from ..ops.attention import CascadeAttentionPlan, resolve_backend as resolve_cascade_backend
from .base import DecoderModel
from .config import ModelConfig
from .dense import dense
from .kv_cache import KVCache, SuffixKV
from .layers import fused_cpu, linear, project, rotate
from .mask_adapter import clean_causal_words
from .plan import AttentionPlan
from .stack import run_layers


class Output(NamedTuple):
    """Result of ``Model.forward``.

    logits : [B, N, V] (or [B, K, V] for selected positions; None when not asked), float in
        the model's dtype.  For a ``shifted`` model logits[:, i] predict token i + 1.
    hidden : None, or the requested hidden states in the order asked, each [B, N, hidden]:
        index 0 = the embeddings, i in 1..L-1 = the output of layer i, L = the final
        (normed) output, as transformers' ``output_hidden_states``.
    suffix_kv : the suffix's keys (after RoPE) and values per layer, for ``KVCache.append``.
    """

    logits: torch.Tensor | None
    hidden: list[torch.Tensor] | None
    suffix_kv: SuffixKV | None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """``fused``: whether dspec._C may run it (None: decided here, see ``fused_cpu``)."""
        dtype = x.dtype
        if fused is None:
            fused = fused_cpu(x, self.weight)
        if fused and x.is_contiguous() and self.weight.dtype == dtype:
            out = torch.empty_like(x)
            _backend.extension().rms_norm(
                x.data_ptr(),
                self.weight.data_ptr(),
                out.data_ptr(),
                _backend.FLOAT_CODE[dtype],
                x.numel() // x.shape[-1],
                x.shape[-1],
                self.eps,
                cpu.layer_threads(),
            )
            return out
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.shape = (hq, hkv, d)

    def rotated_qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool | None = None):
        """h [B, N, hidden] -> q [B, N, Hq, D], k, v [B, N, Hkv, D]; q/k normed (Qwen3) and
        rotated.  Shared by the inference forward and the training forward.  ``fused``:
        whether dspec._C may run the element-wise parts (None: decided here)."""
        batch, n = h.shape[:2]
        hq, hkv, d = self.shape
        q, k, v = project((self.q_proj, self.k_proj, self.v_proj), h)
        q, k, v = q.view(batch, n, hq, d), k.view(batch, n, hkv, d), v.view(batch, n, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q, fused), self.k_norm(k, fused)
        if fused is None:
            fused = fused_cpu(q, k, cos, sin)
        if (
            fused
            and q.is_contiguous()
            and k.is_contiguous()
            and cos.dtype == torch.float32
            and cos.is_contiguous()
            and sin.is_contiguous()
            and k.dtype == q.dtype
            and cos.shape == (batch, n, 1, d)
            and sin.shape == cos.shape
        ):
            # one call rotates q and k in place (fresh tensors of this forward)
            _backend.extension().rope(
                q.data_ptr(),
                k.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                _backend.FLOAT_CODE[q.dtype],
                batch * n,
                hq,
                hkv,
                d,
                cpu.layer_threads(),
            )
            return q, k, v
        return rotate(q, cos, sin), rotate(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project((self.gate_proj, self.up_proj), x)
        return linear(self.down_proj, silu_mul(gate, up))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``; on the CPU without autograd dspec._C.silu_mul (into gate, a
    fresh projection), the SiLU the one-call layer stack uses, so the two agree bit for bit."""
    if (
        fused_cpu(gate, up)
        and gate.is_contiguous()
        and up.is_contiguous()
        and gate.dtype == up.dtype
        and gate.shape == up.shape
        and hasattr(_backend.extension(), "silu_mul")
        and gate.numel()
    ):
        width = gate.shape[-1]
        _backend.extension().silu_mul(
            gate.data_ptr(),
            up.data_ptr(),
            gate.data_ptr(),
            _backend.FLOAT_CODE[gate.dtype],
            gate.numel() // width,
            width,
            cpu.layer_threads(),
        )
        return gate
    return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] float32, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    # llama3: long wavelengths divided by factor, short kept, smooth in between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _no_prefix(layer: int) -> tuple[None, None]:
    return None, None


def plan_attention(config, dtype: torch.dtype, device, batch: int, n: int, mask, cache: KVCache | None, backend):
    """A forward's attention, planned once for every layer: a ``CascadeAttentionPlan`` and
    ``layer_prefix(i) -> (prefix_k, prefix_v)`` (``config``: num_heads, num_kv_heads,
    head_dim; a model's or a DFlash drafter's).  With the C++ CPU kernel (or on CUDA) the
    prefix is the cache's own storage read in place as pages (request b = page b of
    ``capacity`` rows): no copy, no host read.  The torch reference and Triton's interpreter
    on CPU take the committed rows gathered back to back (one gather per layer, the row
    index built once)."""
    common = (batch, n, config.num_heads, config.num_kv_heads, config.head_dim, dtype, device, mask)
    if cache is None or cache.length_bound == 0:
        return CascadeAttentionPlan(*common, backend=backend), _no_prefix
    if (
        cache.resolved_layout == "paged"
        or resolve_cascade_backend(backend, device, dtype, torch.is_grad_enabled()) == "cpp"
    ):
        table, lens = cache.page_table()
        plan = CascadeAttentionPlan(
            *common, prefix_page_table=table, prefix_lens=lens, max_prefix_len=cache.length_bound, backend=backend
        )
        return plan, cache.layer_pages
    if cache.max_length == 0:
        return CascadeAttentionPlan(*common, backend=backend), _no_prefix
    indptr = cache.ragged_indptr()
    plan = CascadeAttentionPlan(*common, prefix_indptr=indptr, backend=backend)
    return plan, cache.layer_rows


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, *, table: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables of positions [...] -> (cos, signed sin), each [..., 1, D] float32 (a head
    axis to broadcast over): ``signed sin = (-sin, +sin)`` over the two halves, what
    ``rotate`` takes.  Computed once per forward and shared by every layer.

    On the CPU the rows are gathered from a table of positions 0 .. P-1 kept with
    ``inv_freq`` (grown by doubling): torch's CPU sin / cos call MKL's vector math, which
    opens an OpenMP team for as few as 128 elements, and that team's workers then spin for
    milliseconds on the cores the decoder's own threads need (SmolLM2-135M, bf16, 2 cores:
    a 16-token forward ran 13.8 ms with them, see bench_forward).  The table rows are the
    formula's values computed once, so every CPU path (inference, training, drafters)
    reads the same bits.  Sizing the table reads the largest position on the host:
    ``table=False`` computes the formula instead (a forward emulating a device backend,
    which must not read the host); None: the table for CPU positions."""
    if table is not False and positions.is_cpu and positions.numel():
        lo, hi = torch.aminmax(positions)
        if int(lo) >= 0:
            cos_table, sin_table = _cpu_rope_table(inv_freq, int(hi) + 1)
            index = positions.reshape(-1).to(torch.int64)
            shape = tuple(positions.shape) + (1, cos_table.shape[-1])
            return cos_table.index_select(0, index).view(shape), sin_table.index_select(0, index).view(shape)
    return rope_formula(positions, inv_freq)


def rope_formula(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos / sin at ``positions`` [...] for ``inv_freq`` [D / 2], each [..., 1, D]
    float32, the sin's first half negated: a rotation is then ``x * cos + swap(x) * sin``,
    ``swap`` exchanging the two halves of the head dimension."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
    sin = emb.sin()
    half = sin.shape[-1] // 2
    sin[..., :half].neg_()
    return emb.cos(), sin


ROPE_TABLE_ATTR = "_dspec_rope_table"


def _cpu_rope_table(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [P, D] float32 for positions 0 .. P-1, P >= ``positions`` (a power
    of two >= 256), kept as an attribute of ``inv_freq`` (rebuilt when it changes in place)."""
    key = (inv_freq.data_ptr(), inv_freq._version)
    kept = getattr(inv_freq, ROPE_TABLE_ATTR, None)
    if kept is not None and kept[0] == key and kept[1].shape[0] >= positions:
        return kept[1], kept[2]
    size = max(256, 1 << (positions - 1).bit_length())
    cos, sin = rope_formula(torch.arange(size, device=inv_freq.device), inv_freq)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    setattr(inv_freq, ROPE_TABLE_ATTR, (key, cos, sin))
    return cos, sin


class Model(DecoderModel):
    """A loaded checkpoint: the lean transformer plus what describes it.

    Attributes: ``config`` (ModelConfig), ``family``, ``tokenizer`` (or None),
    ``mask_token_id`` (None for causal LMs), ``shifted`` (Dream-style right-shifted
    logits), ``attention`` ("causal" | "bidirectional" | "block_causal"), ``block_size``
    (block-causal families), ``eos_token_ids``.

    ``forward(plan)`` runs an ``AttentionPlan``; ``new_cache(B)`` makes a matching
    ``KVCache``; ``plan(seqs, cache)`` builds the plan of a ragged batch under the model's
    own attention.
    """

    def __init__(self, config: ModelConfig, *, tokenizer=None, device="cpu", dtype=torch.float32, _meta: bool = False):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.name_or_path = None
        self.shipped_name = None  # set by dspec.load for a shipped model ("tiny-ar", ...)
        with torch.device("meta" if _meta else device):
            # a meta Embedding gets no init: reset_parameters' normal_ on a meta tensor runs
            # torch's Python reference, which imports torch._dynamo (seconds per dspec.load)
            shape = (config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape)) if _meta else nn.Embedding(*shape)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        if not _meta:
            self.to(dtype=dtype)
        self._inv_freq = {}  # float32 RoPE frequencies per device (not a buffer: .to(bf16) must not touch them)
        self.mask_adapter = None  # a MaskAdapter (dspec.models.mask_adapter) when attached

    # ------------------------------------------------------------------------ description

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def shifted(self) -> bool:
        return self.config.shifted

    @property
    def attention(self) -> str:
        return self.config.attention

    @property
    def block_causal(self) -> bool:
        return self.config.attention == "block_causal"

    @property
    def block_size(self) -> int | None:
        return self.config.block_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final normed hidden states [..., D] (``hidden_states=[-1]``) ->
        logits [..., V] in the model's dtype, as ``forward`` computes them."""
        out = dense(hidden, self.output_weight)
        scale = self.config.logit_scale
        return out * scale if scale != 1.0 else out

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"family={c.family}, layers={c.num_layers}, hidden={c.hidden_size}, heads={c.num_heads}/"
            f"{c.num_kv_heads}x{c.head_dim}, vocab={c.vocab_size}, attention={c.attention}, "
            f"shifted={c.shifted}, mask_token_id={c.mask_token_id}"
        )

    @torch.no_grad()
    def init_random_(self, std: float = 0.02, *, seed: int | None = None) -> "Model":
        """Normal(0, std) weights, zero biases, unit norms (tests, training from scratch)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    # ------------------------------------------------------------------------- helpers

    def new_cache(self, batch_size: int, *, capacity: int = 0, layout: str = "auto") -> KVCache:
        """An empty KVCache shaped for this model."""
        c = self.config
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
            capacity=capacity,
            layout=layout,
        )

    def plan(
        self,
        seqs,
        cache: KVCache | None = None,
        *,
        attention: str | None = None,
        block_size: int | None = None,
        lengths=None,
    ) -> AttentionPlan:
        """The plan of token sequences (ragged, right-padded) after ``cache``'s prefixes,
        under the model's own attention (or ``attention``); block-causal attention uses
        ``block_size`` (default: the model's), which must be the block size the caller
        decodes with so the committed prompt blocks match the decoded ones.  ``lengths``:
        with a [B, N] tensor of seqs, each row's valid tokens (``AttentionPlan.sequences``)."""
        pad = self.config.pad_token_id
        pad = pad if pad is not None and 0 <= pad < self.config.vocab_size else 0
        return AttentionPlan.sequences(
            seqs,
            attention=attention or self.config.attention,
            block_size=block_size or self.config.block_size,
            cache=cache,
            pad_id=pad,
            device=self.device,
            lengths=lengths,
        )

    # ------------------------------------------------------------------------- forward

    def forward(
        self,
        plan: AttentionPlan,
        *,
        logits="all",
        hidden_states: Sequence[int] | None = None,
        return_kv: bool = True,
        backend: str | None = None,
    ) -> Output:
        """Run one attention plan.

        logits : "all" (default) for [B, N, V]; "last" for [B, 1, V] at each request's last
            valid suffix token (``plan.lengths`` - 1, else N - 1); an int tensor of suffix
            indices [K] or [B, K] for [B, K, V]; None / False to skip the LM head.
        hidden_states : indices into (embeddings, layer 1 .. L-1 outputs, final normed
            output), as transformers' ``output_hidden_states``; negative indices count from
            the end.  Returned in ``Output.hidden`` in the order asked.
        return_kv : keep the suffix keys/values (``Output.suffix_kv``) for committing.
        backend : cascade_attention's backend (default: ``DSPEC_BACKEND`` / auto).
        """
        tokens, positions, mask, cache = self._check_plan(plan)
        cfg = self.config
        want = self._hidden_indices(hidden_states)

        x = self.embed_tokens(tokens)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        adapter = self.mask_adapter
        if adapter is not None or cfg.clean_causal:
            is_mask = tokens == cfg.mask_token_id
            any_mask = bool(is_mask.any())  # one host read per forward
            if cfg.clean_causal:
                mask = clean_causal_words(mask, positions, is_mask, any_mask)
            if adapter is not None:
                x = adapter.begin(tokens, x, is_mask, any_mask)
        try:
            return self._layers(x, positions, mask, cache, plan, want, logits, hidden_states, return_kv, backend)
        finally:
            if adapter is not None:
                adapter.end()

    def _layers(self, x, positions, mask, cache, plan, want, logits, hidden_states, return_kv, backend) -> Output:
        cfg = self.config
        batch, n = x.shape[:2]
        recorded = {}
        if 0 in want:
            recorded[0] = x
        attention, layer_prefix = plan_attention(cfg, self.dtype, self.device, batch, n, mask, cache, backend)  # once
        cos, sin = rope_tables(positions, self._rope(x.device), table=attention.backend == "cpp")  # [B, N, 1, D]

        keys, values = [], []
        d, hq = cfg.head_dim, cfg.num_heads
        # decided once for every layer: the fused C++ element-wise ops apply (CPU, no autograd)
        fused = fused_cpu(x, self.norm.weight, cos, sin)
        stacked = (
            run_layers(self, x.clone() if 0 in want else x, cos, sin, attention, layer_prefix, want, return_kv)
            if fused
            else None
        )
        stacked_kv = None
        if stacked is not None:  # every layer in one C++ call
            x, stacked_kv, layer_outputs = stacked
            recorded.update(layer_outputs)
        for i, layer in enumerate(self.layers if stacked is None else ()):
            attn = layer.self_attn
            q, k, v = attn.rotated_qkv(layer.input_layernorm(x, fused), cos, sin, fused)
            o = attention.run(q, k, v, *layer_prefix(i))
            x = x + linear(attn.o_proj, o.reshape(batch, n, hq * d))
            x = x + layer.mlp.forward(layer.post_attention_layernorm(x, fused))
            if i + 1 in want and i + 1 < cfg.num_layers:
                recorded[i + 1] = x
            if return_kv:
                keys.append(k)
                values.append(v)
        x = self.norm(x, fused)
        if cfg.num_layers in want:
            recorded[cfg.num_layers] = x

        out_logits = None
        if logits is not None and logits is not False:
            out_logits = self.head(self._select(x, logits, plan, batch, n))
        hidden = None
        if hidden_states is not None:
            hidden = [recorded[j] for j in self._hidden_order(hidden_states)]
        suffix_kv = None
        if return_kv:
            suffix_kv = SuffixKV(stacked=stacked_kv) if stacked_kv is not None else SuffixKV(keys, values)
        return Output(out_logits, hidden, suffix_kv)

    # ------------------------------------------------------------------------- checks

    def _rope(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(self.config).to(device)
        return self._inv_freq[key]

    def _hidden_order(self, hidden_states) -> list[int]:
        total = self.config.num_layers + 1
        if isinstance(hidden_states, int):
            hidden_states = [hidden_states]
        out = []
        for j in hidden_states:
            if isinstance(j, bool) or not isinstance(j, int) or not -total <= j < total:
                raise ValueError(
                    f"hidden_states must hold ints in [-{total}, {total}) (0 = embeddings, "
                    f"{total - 1} = final normed output), got {j!r}"
                )
            out.append(j % total)
        return out

    def _hidden_indices(self, hidden_states) -> set[int]:
        return set() if hidden_states is None else set(self._hidden_order(hidden_states))

    def _select(self, x, logits, plan, batch, n):
        if isinstance(logits, str):
            if logits == "all":
                return x
            if logits == "last":
                if plan.lengths is not None:
                    last = torch.as_tensor(plan.lengths, device=x.device).to(torch.int64) - 1
                else:
                    last = torch.full((batch,), n - 1, dtype=torch.int64, device=x.device)
                return x[torch.arange(batch, device=x.device), last][:, None]
            raise ValueError(f"logits must be 'all', 'last', None or an index tensor, got {logits!r}")
        if logits is True:
            return x
        idx = torch.as_tensor(logits, device=x.device)
        if idx.is_floating_point() or idx.dtype == torch.bool or idx.dim() not in (1, 2):
            raise ValueError(
                f"logits as indices must be an int tensor [K] or [B, K], got {idx.dtype} {list(idx.shape)}"
            )
        idx = idx.to(torch.int64)
        if idx.dim() == 1:
            idx = idx.expand(batch, -1)
        if idx.shape[0] != batch:
            raise ValueError(f"logits indices must have B = {batch} rows, got {list(idx.shape)}")
        if idx.numel() and _validate.value_checks_enabled(idx) and bool(((idx < 0) | (idx >= n)).any()):
            raise ValueError(f"logits indices must lie in [0, N = {n})")
        return torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))

    def _check_plan(self, plan):
        if not isinstance(plan, AttentionPlan):
            raise ValueError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        cfg = self.config
        dev = self.device
        tokens, positions = plan.tokens, plan.positions
        _validate.tensor("plan.tokens", tokens, dim=2, dtypes=_validate.ID_DTYPES)
        _validate.tensor("plan.positions", positions, dim=2, dtypes=_validate.ID_DTYPES)
        if positions.shape != tokens.shape:
            raise ValueError(
                f"plan.positions must have the shape of plan.tokens {list(tokens.shape)}, got {list(positions.shape)}"
            )
        if tokens.shape[1] == 0:
            raise ValueError("plan.tokens has no suffix token (N = 0)")
        for name, t in (("plan.tokens", tokens), ("plan.positions", positions)):
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device}, the model on {dev}")
        if _validate.value_checks_enabled(tokens):
            if bool(((tokens < 0) | (tokens >= cfg.vocab_size)).any()):
                raise ValueError(f"plan.tokens must lie in [0, vocab_size = {cfg.vocab_size})")
            if bool((positions < 0).any()):
                raise ValueError("plan.positions must be >= 0")
        mask = plan.mask
        if mask is not None and mask.device != dev:
            raise ValueError(f"plan.mask is on {mask.device}, the model on {dev}")
        cache = plan.cache
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ValueError(f"plan.cache must be a KVCache or None, got {type(cache).__name__}")
            if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
            ):
                raise ValueError(
                    f"plan.cache has layers/kv_heads/head_dim = {cache.num_layers}/"
                    f"{cache.num_kv_heads}/{cache.head_dim}, the model "
                    f"{cfg.num_layers}/{cfg.num_kv_heads}/{cfg.head_dim}"
                )
            if cache.batch_size != tokens.shape[0]:
                raise ValueError(f"plan.cache holds {cache.batch_size} requests, plan.tokens {tokens.shape[0]}")
            if cache.dtype != self.dtype or cache.device != dev:
                raise ValueError(f"plan.cache is {cache.dtype} on {cache.device}, the model {self.dtype} on {dev}")
        return tokens.long(), positions, mask, cache

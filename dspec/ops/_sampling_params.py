"""Per-request temperature / top_k / top_p and per-request generators for the verify ops and
token_stats.

A call with a scalar temperature, top_k and top_p off and at most one generator never comes
here (the wrappers' own path, unchanged).  Otherwise sampled rows (T_b > 0) run the wrapped
op at temperature 1.0 on :func:`dspec.reference.sampling_params.filter_logits` (logits / T_b,
-inf outside the row's top-k / top-p set) and greedy rows (T_b <= 0) run it greedily on the
raw logits; results merge in row order.
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..reference.sampling_params import filter_logits


def engaged(temperature, top_k, top_p, generator) -> bool:
    """Whether a call needs the per-request path (anything beyond a scalar temperature)."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 1:
        return True
    if isinstance(generator, (list, tuple)):
        return True
    if isinstance(top_k, torch.Tensor) or isinstance(top_p, torch.Tensor):
        return True
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0):
        return True
    return not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 1.0)


def _per_row(name, value, batch, device, dtypes, what):
    """A [B] tensor on ``device`` from a number or a [B] tensor (on ``device`` or the CPU)."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        _validate.tensor(name, value, dim=1, dtypes=dtypes)
        if value.shape[0] != batch:
            raise ValueError(f"{name} must have shape [B] = [{batch}], got {list(value.shape)}")
        if value.device != device and value.device.type != "cpu":
            raise ValueError(f"{name} is on {value.device}, expected {device} like the logits (or the CPU)")
        return value.to(device)
    v = _validate.real(name, value, what=what)
    if dtypes == _validate.ID_DTYPES:
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, float) or v != int(v):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return torch.full((batch,), int(v), dtype=torch.int64, device=device)
    return torch.full((batch,), v, dtype=torch.float32, device=device)


def params(temperature, top_k, top_p, generator, batch: int, device: torch.device):
    """Checked (temperature float32 [B], top_k int64 [B], top_p float32 [B], generators).

    ``generators`` is None, one generator, or a list of B generators.  Tensor values are read
    (one host copy) while value checks are on.
    """
    t = _per_row(
        "temperature",
        temperature,
        batch,
        device,
        _validate.FLOAT_DTYPES,
        "a number or a float tensor [B] (<= 0 for greedy)",
    )
    k = _per_row("top_k", top_k, batch, device, _validate.ID_DTYPES, "an int or an int tensor [B] (0 = off)")
    p = _per_row(
        "top_p", top_p, batch, device, _validate.FLOAT_DTYPES, "a number in (0, 1] or a float tensor [B] (1.0 = off)"
    )
    t, p = t.float(), p.float()
    scalar_checks = not isinstance(temperature, torch.Tensor) or temperature.dim() == 0
    if batch and (scalar_checks or _validate.value_checks_enabled(t)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise ValueError(
                f"temperature must be finite (<= 0 for greedy); "
                f"temperature[{int(bad.nonzero()[0])}] = {float(t[bad][0])}"
            )
    if batch and (not isinstance(top_k, torch.Tensor) or _validate.value_checks_enabled(k)):
        if bool((k < 0).any()):
            raise ValueError(f"top_k must be >= 0 (0 = off), got {int(k.min())}")
    if batch and (not isinstance(top_p, torch.Tensor) or _validate.value_checks_enabled(p)):
        bad = ~((p > 0) & (p <= 1))
        if bool(bad.any()):
            raise ValueError(f"top_p must lie in (0, 1] (1.0 = off), got {float(p[bad][0])}")
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(
                f"generator must be one torch.Generator or a list of B = {batch}, got a list of {len(generator)}"
            )
        for i, g in enumerate(generator):
            if not isinstance(g, torch.Generator):
                raise ValueError(f"generator[{i}] must be a torch.Generator, got {type(g).__name__}")
            _validate.generator(g, device)
        generator = list(generator)
    else:
        _validate.generator(generator, device)
    return t, k, p, generator


def _draw(generator, coins, uniforms, coin_shape, sampled_rows, device):
    """coins / sample_uniforms for the sampled call: given ones pass through; with a list of
    generators row b's are drawn from generator b exactly as a one-row call draws them (coins
    [1, ...] then uniforms [1]), only for sampled rows; otherwise None (the op draws them from
    the one generator, for the whole batch)."""
    if not isinstance(generator, list) or (coins is not None and uniforms is not None):
        return coins, uniforms
    batch = coin_shape[0]
    c = torch.zeros(coin_shape, dtype=torch.float32, device=device) if coins is None else coins
    u = torch.zeros((batch,), dtype=torch.float32, device=device) if uniforms is None else uniforms
    for b in sampled_rows:
        if coins is None:
            c[b] = torch.rand((1, *coin_shape[1:]), generator=generator[b], device=device)[0]
        if uniforms is None:
            u[b] = torch.rand((1,), generator=generator[b], device=device)[0]
    return c, u


def _merge(greedy_rows: torch.Tensor, greedy_out, sampled_out):
    merged = []
    for g, s in zip(greedy_out, sampled_out):
        m = greedy_rows.view(-1, *([1] * (g.dim() - 1)))
        merged.append(torch.where(m, g, s))
    return type(greedy_out)(*merged)


def verify(
    op,
    target_logits: torch.Tensor,
    temperature,
    top_k,
    top_p,
    generator,
    coins,
    sample_uniforms,
    coin_shape: tuple,
    backend,
    **others,
):
    """Run verify op ``op`` (verify_chain / verify_tree; ``others`` its remaining keywords)
    with per-request temperature / top_k / top_p / generators."""
    batch, device = target_logits.shape[0], target_logits.device
    t, k, p, generator = params(temperature, top_k, top_p, generator, batch, device)
    filtering = (
        not (
            isinstance(temperature, (int, float)) or (isinstance(temperature, torch.Tensor) and temperature.dim() == 0)
        )
        or isinstance(top_k, torch.Tensor)
        or isinstance(top_p, torch.Tensor)
        or top_k != 0
        or top_p != 1.0
    )
    known = isinstance(generator, list) or t.device.type == "cpu" or not batch or _validate.value_checks_enabled(t)
    greedy = t <= 0
    if known:  # which rows are greedy, read on the host
        flags = greedy.tolist()
        any_greedy, any_sampled = any(flags), not all(flags)
        sampled_rows = [b for b, f in enumerate(flags) if not f]
    else:  # sync-free: run both, merge on the device
        any_greedy = any_sampled = True
        sampled_rows = list(range(batch))
    common = dict(others, backend=backend)
    greedy_out = sampled_out = None
    if any_greedy or not batch:
        greedy_out = op(target_logits=target_logits, temperature=0.0, **common)
    if any_sampled and batch:
        c, u = _draw(generator, coins, sample_uniforms, coin_shape, sampled_rows, device)
        g = None if isinstance(generator, list) else generator
        if filtering:
            logits = filter_logits(target_logits, torch.where(greedy, 1.0, t), k, p)
            sampled_out = op(target_logits=logits, temperature=1.0, coins=c, sample_uniforms=u, generator=g, **common)
        else:  # a scalar T > 0 with per-row generators
            sampled_out = op(
                target_logits=target_logits, temperature=float(t[0]), coins=c, sample_uniforms=u, generator=g, **common
            )
    if sampled_out is None:
        return greedy_out
    if greedy_out is None:
        return sampled_out
    return _merge(greedy, greedy_out, sampled_out)


def token_stats(op, logits: torch.Tensor, temperature, top_k, top_p, backend):
    """token_stats with per-request temperature / top_k / top_p over ``logits``' first dim."""
    if logits.dim() < 2:
        raise ValueError(
            f"logits must have a leading request dimension [B, ..., V] with per-request "
            f"temperature / top_k / top_p, got shape {tuple(logits.shape)}"
        )
    batch, device = logits.shape[0], logits.device
    t, k, p, _ = params(temperature, top_k, top_p, None, batch, device)
    if isinstance(temperature, (int, float)) or (isinstance(temperature, torch.Tensor) and temperature.dim() == 0):
        _validate.temperature(temperature)  # a scalar stays positive, as without filters
    greedy = t <= 0
    filtered = filter_logits(logits, torch.where(greedy, 1.0, t), k, p)
    s = op(filtered, temperature=1.0, backend=backend)
    raw = op(logits, temperature=1.0, backend=backend)
    # greedy rows: the one-hot distribution on the argmax (lse: the row maximum, the T -> 0
    # limit of T * logsumexp(logits / T)); invalid rows as token_stats gives them
    valid = raw.token >= 0
    nan = torch.full_like(raw.prob, math.nan)
    one = torch.where(valid, 1.0, nan)
    rowmax = logits.float().amax(-1)
    g = type(s)(raw.token, one, one, torch.where(valid, 0.0, nan), torch.where(valid, rowmax, raw.lse))
    return _merge(greedy, g, s)

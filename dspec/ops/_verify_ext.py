"""verify_chain / verify_tree through dspec._C (the "cuda" and "cpp" backends).

Pointer marshalling only: the public wrappers in ops/verify.py have validated shapes,
dtypes, devices and values.  Token ids go to the extension as they are, int32 or int64,
with a dtype code (no conversion); ``num_drafts`` is converted to int64 (a [B] tensor).
Everything the launch needs is allocated here (outputs and one workspace), so the launch
itself allocates nothing and never synchronises with the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from .. import _backend, cpu
from ..types import TreeVerifyOutput, VerifyOutput


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _launch_config(ext, rows: int, batch: int, vocab: int, dtype_code: int, dev: torch.device, cuda: bool):
    """(ts_splits, draw_splits, stream) for a launch on ``dev``."""
    if not cuda:
        return 1, 1, 0
    ts_splits = _backend.vocab_splits(rows, vocab, ext.token_stats_tile, dev, min_tiles_per_split=2)
    draw_splits = _backend.vocab_splits(batch, vocab, ext.verify_draw_tile(dtype_code), dev, min_tiles_per_split=2)
    return ts_splits, draw_splits, _backend.cuda_stream(dev, True)


def _workspace(nbytes: int, dev: torch.device) -> torch.Tensor:
    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=dev)


def verify_chain_ext(
    draft_tokens,
    target_logits,
    draft_probs,
    num_drafts,
    temperature,
    coins,
    sample_uniforms,
    *,
    cuda: bool,
    rule: str = "token",
) -> VerifyOutput:
    ext = _backend.extension()
    batch, length = draft_tokens.shape
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    num = torch.empty(batch, dtype=torch.int64, device=dev)
    out = torch.empty(batch, length + 1, dtype=torch.int64, device=dev)
    if batch == 0:
        return VerifyOutput(num, out)
    logits = _backend.as_rows(target_logits)
    code = _backend.FLOAT_CODE[logits.dtype]
    sampling = temperature > 0
    drafts = draft_tokens.contiguous()
    ndraft = None if num_drafts is None else num_drafts.to(torch.int64).contiguous()
    q = None
    if draft_probs is not None and sampling:
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    coins_t = coins.float().contiguous() if sampling else None
    uniforms_t = sample_uniforms.float().contiguous() if sampling else None
    ts_splits, draw_splits, stream = _launch_config(ext, batch * (length + 1), batch, vocab, code, dev, cuda)
    rule_code = 1 if rule == "block" and sampling else 0
    ws = _workspace(ext.verify_chain_workspace_bytes(batch, length, vocab, code, sampling, ts_splits, rule_code), dev)
    with _backend.launch_context(dev, cuda):  # launch on the logits' GPU
        ext.verify_chain(
            logits.data_ptr(),
            code,
            batch,
            length,
            vocab,
            logits.stride(0),
            _ptr(drafts),
            _backend.ID_CODE[drafts.dtype],
            _ptr(ndraft),
            _ptr(q),
            _backend.FLOAT_CODE[q.dtype] if q is not None else 0,
            q.stride(0) if q is not None else 0,
            q.stride(1) if q is not None else 0,
            _ptr(coins_t),
            _ptr(uniforms_t),
            float(temperature),
            num.data_ptr(),
            out.data_ptr(),
            "cuda" if cuda else "cpu",
            stream,
            ts_splits,
            draw_splits,
            ws.data_ptr(),
            ws.numel(),
            cpu.kernel_threads(),
            rule_code,
        )
    return VerifyOutput(num, out)


def verify_tree_ext(
    tokens,
    parents,
    target_logits,
    temperature,
    coins,
    sample_uniforms,
    *,
    cuda: bool,
    draft_probs=None,
    draft_sampling: str = "independent",
) -> TreeVerifyOutput:
    ext = _backend.extension()
    batch, nodes = tokens.shape
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    num = torch.empty(batch, dtype=torch.int64, device=dev)
    path = torch.empty(batch, nodes, dtype=torch.int64, device=dev)
    out = torch.empty(batch, nodes, dtype=torch.int64, device=dev)
    if batch == 0:
        return TreeVerifyOutput(num, path, out)
    logits = _backend.as_rows(target_logits)
    code = _backend.FLOAT_CODE[logits.dtype]
    sampling = temperature > 0
    tok = tokens.contiguous()
    par = parents.contiguous()
    q = None
    if draft_probs is not None and sampling:
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    coins_t = coins.float().contiguous() if sampling else None
    uniforms_t = sample_uniforms.float().contiguous() if sampling else None
    ts_splits, draw_splits, stream = _launch_config(ext, batch * nodes, batch, vocab, code, dev, cuda)
    ws = _workspace(ext.verify_tree_workspace_bytes(batch, nodes, vocab, code, sampling, ts_splits, q is not None), dev)
    with _backend.launch_context(dev, cuda):
        ext.verify_tree(
            logits.data_ptr(),
            code,
            batch,
            nodes,
            vocab,
            logits.stride(0),
            tok.data_ptr(),
            _backend.ID_CODE[tok.dtype],
            par.data_ptr(),
            _backend.ID_CODE[par.dtype],
            _ptr(coins_t),
            _ptr(uniforms_t),
            float(temperature),
            num.data_ptr(),
            path.data_ptr(),
            out.data_ptr(),
            "cuda" if cuda else "cpu",
            stream,
            ts_splits,
            draw_splits,
            ws.data_ptr(),
            ws.numel(),
            cpu.kernel_threads(),
            _ptr(q),
            _backend.FLOAT_CODE[q.dtype] if q is not None else 0,
            q.stride(0) if q is not None else 0,
            q.stride(1) if q is not None else 0,
            int(draft_sampling == "without_replacement"),
        )
    return TreeVerifyOutput(num, path, out)

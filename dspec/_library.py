"""dspec's public ops as ``torch.library`` custom ops (namespace ``dspec``).

Why: an engine that wraps its decode step in ``torch.compile(fullgraph=True)`` or captures
it in a CUDA graph must see each dspec call as one opaque operator with known output
shapes, not as Python that reads tensor values.  Every public wrapper in ``dspec.ops``
therefore

1. validates shapes, dtypes and devices in Python (metadata only, so it works on the
   FakeTensors ``torch.compile`` traces with; the checks that read values are skipped while
   tracing or capturing, see ``dspec._validate.value_checks_enabled``);
2. draws any random numbers it needs (``generator=`` cannot cross the op boundary);
3. resolves ``backend=`` to a concrete name ("torch", "triton", "cuda" or "cpp");
4. calls ``torch.ops.dspec.<op>(..., backend)`` (or, in a plain eager call, its body),
   whose fake (meta) implementation below gives the output shapes and dtypes without
   running anything.

The ops are functional (no input is mutated, no output aliases an input) and have no
autograd formula.  Plain eager calls, and calls that autograd must see, run the op's body
directly (see ``call_directly``); tracing and dispatch modes always see the custom op.

They are registered with ``torch.library.Library`` (schema + a CompositeExplicitAutograd
kernel + ``register_fake``) rather than ``torch.library.custom_op``, whose call path
imports ``torch._dynamo`` (and with it Triton) on the first eager call: a plain CPU call of
a dspec op must stay as light as before.

Every op returns a fixed number of tensors; the wrappers rebuild the public NamedTuples
(``TokenStats``, ``VerifyOutput``, ...).  ``cascade_attention`` always returns
``(out, lse)``; with ``return_lse=False`` the lse is an empty tensor of shape [0].
"""

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _backend

_NS = "dspec"


# Backend choice depends only on the device, the argument, $DSPEC_BACKEND and what is
# installed: torch.compile evaluates it once while tracing (a constant in the graph) instead
# of tracing through the import machinery behind it.
# (looked up at call time, so a patched ``_backend.resolve`` is honoured)
def resolve(op: str, backend, device, provided, unsupported=None) -> str:
    """``_backend.resolve`` (see there)."""
    return _backend.resolve(op, backend, device, provided, unsupported)


# What ``torch.compiler.assume_constant_result(resolve)`` does, without importing
# torch._dynamo (and Triton with it) when dspec is imported.
resolve._dynamo_marked_constant = True


def _fresh(*outs: Tensor) -> tuple:
    """Outputs of a custom op must be contiguous new tensors matching the fake shapes."""
    return tuple(o.contiguous() for o in outs)


_PLAIN = (Tensor, torch.nn.Parameter)


def call_directly(*tensors) -> bool:
    """Whether a public wrapper should run the op's body itself instead of the custom op.

    The custom op is what tracing and dispatch modes must see (``torch.compile``, export,
    FakeTensor / functionalisation modes, ``dspec.testing``), so it is used whenever one is
    active or an input is a tensor subclass.  A plain eager call skips the dispatcher round
    trip (tens of microseconds per call, per layer for cascade_attention), and a call that
    autograd must see (grad mode on, an input requiring grad: training through the torch
    reference) runs the body so autograd records the reference's operators.
    """
    if torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    if _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


_lib = torch.library.Library(_NS, "DEF")  # kept alive for the life of the process
IMPLS = {}  # op name -> its Python body (dspec.testing enters it)
# op name -> the backend dispatch it runs, registered by its dspec.ops module (``body``):
# this module never imports dspec.ops, so imports flow one way (ops -> _library)
BODIES = {}


def body(name: str):
    """Register the decorated function as the implementation the custom op ``name`` runs."""

    def register(fn):
        BODIES[name] = fn
        return fn

    return register


def _op(schema: str):
    """Define ``dspec::<schema>`` with the decorated function as its kernel (every device)."""
    name = schema.split("(", 1)[0]

    def register(fn):
        _lib.define(schema)
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        IMPLS[name] = fn
        return getattr(getattr(torch.ops, _NS), name).default

    return register


def _fake(name: str):
    return torch.library.register_fake(f"{_NS}::{name}", lib=_lib)


# ---------------------------------------------------------------------------- scoring


@_op("token_stats(Tensor logits, float temperature, str backend) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def token_stats(logits, temperature, backend):
    return _fresh(*BODIES['token_stats'](logits, temperature, backend))


@_fake("token_stats")
def _(logits, temperature, backend):
    lead = logits.shape[:-1]
    token = logits.new_empty(lead, dtype=torch.int64)
    return (token,) + tuple(logits.new_empty(lead, dtype=torch.float32) for _ in range(4))


@_op("topk_tokens(Tensor logits, int k, float temperature, str backend) -> (Tensor, Tensor)")
def topk_tokens(logits, k, temperature, backend):
    return _fresh(*BODIES['topk_tokens'](logits, k, temperature, backend))


@_fake("topk_tokens")
def _(logits, k, temperature, backend):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


@_op("mass_candidates(Tensor logits, float tau, int max_m, float temperature, str backend) -> (Tensor, Tensor, Tensor)")
def mass_candidates(logits, tau, max_m, temperature, backend):
    return _fresh(*BODIES['mass_candidates'](logits, tau, max_m, temperature, backend))


@_fake("mass_candidates")
def _(logits, tau, max_m, temperature, backend):
    lead = logits.shape[:-1]
    return (
        logits.new_empty((*lead, max_m), dtype=torch.int64),
        logits.new_empty((*lead, max_m), dtype=torch.float32),
        logits.new_empty(lead, dtype=torch.int64),
    )


@_op("boundary_posterior(Tensor conf, str backend) -> Tensor")
def boundary_posterior(conf, backend):
    return BODIES['boundary_posterior'](conf, backend).contiguous()


@_fake("boundary_posterior")
def _(conf, backend):
    return conf.new_empty((conf.shape[0], conf.shape[1] + 1), dtype=torch.float32)


@_op("rejection_boundaries(Tensor conf, int k, str backend) -> (Tensor, Tensor)")
def rejection_boundaries(conf, k, backend):
    return _fresh(*BODIES['rejection_boundaries'](conf, k, backend))


@_fake("rejection_boundaries")
def _(conf, k, backend):
    shape = (conf.shape[0], k)
    return conf.new_empty(shape, dtype=torch.int64), conf.new_empty(shape, dtype=torch.float32)


@_op("expected_accept_length(Tensor conf, str backend) -> Tensor")
def expected_accept_length(conf, backend):
    return BODIES['expected_accept_length'](conf, backend).contiguous()


@_fake("expected_accept_length")
def _(conf, backend):
    return conf.new_empty((conf.shape[0],), dtype=torch.float32)


# ----------------------------------------------------------------------- verification


@_op(
    "verify_chain(Tensor draft_tokens, Tensor target_logits, Tensor? draft_probs, Tensor? num_drafts, "
    "float temperature, Tensor? coins, Tensor? sample_uniforms, str backend, str rule=\"token\") "
    "-> (Tensor, Tensor)"
)
def verify_chain(
    draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, backend, rule="token"
):
    return _fresh(
        *BODIES['verify_chain'](
            draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, backend, rule
        )
    )


@_fake("verify_chain")
def _(draft_tokens, target_logits, draft_probs, num_drafts, temperature, coins, sample_uniforms, backend, rule="token"):
    batch, length = draft_tokens.shape
    return (
        target_logits.new_empty((batch,), dtype=torch.int64),
        target_logits.new_empty((batch, length + 1), dtype=torch.int64),
    )


@_op(
    "verify_tree(Tensor tokens, Tensor parents, Tensor target_logits, Tensor? draft_probs, "
    "str draft_sampling, float temperature, Tensor? coins, Tensor? sample_uniforms, str backend) "
    "-> (Tensor, Tensor, Tensor)"
)
def verify_tree(
    tokens, parents, target_logits, draft_probs, draft_sampling, temperature, coins, sample_uniforms, backend
):
    return _fresh(
        *BODIES['verify_tree'](
            tokens, parents, target_logits, draft_probs, draft_sampling, temperature, coins, sample_uniforms, backend
        )
    )


@_fake("verify_tree")
def _(tokens, parents, target_logits, draft_probs, draft_sampling, temperature, coins, sample_uniforms, backend):
    batch, nodes = tokens.shape
    return (
        target_logits.new_empty((batch,), dtype=torch.int64),
        target_logits.new_empty((batch, nodes), dtype=torch.int64),
        target_logits.new_empty((batch, nodes), dtype=torch.int64),
    )


@_op(
    "best_first_tree(Tensor slot_probs, Tensor slot_tokens, int num_nodes, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
def best_first_tree(slot_probs, slot_tokens, num_nodes, backend):
    return _fresh(*BODIES['best_first_tree'](slot_probs, slot_tokens, num_nodes, backend))


@_fake("best_first_tree")
def _(slot_probs, slot_tokens, num_nodes, backend):
    batch, slots, k = slot_probs.shape
    total, width = 0, 1  # N = min(num_nodes, k + k^2 + ... + k^L)
    for _ in range(slots):
        if total >= num_nodes:
            break
        width = min(num_nodes, width * k)
        total = min(num_nodes, total + width)
    shape = (batch, total)
    return (
        slot_probs.new_empty(shape, dtype=torch.int64),
        slot_probs.new_empty(shape, dtype=torch.int64),
        slot_probs.new_empty(shape, dtype=torch.float32),
        slot_probs.new_empty(shape, dtype=torch.int64),
    )


# -------------------------------------------------------------------- masks, attention


@_op("pack_mask(Tensor mask, str backend) -> Tensor")
def pack_mask(mask, backend):
    return BODIES['pack_mask'](mask, backend).contiguous()


@_fake("pack_mask")
def _(mask, backend):
    return mask.new_empty((*mask.shape[:-1], (mask.shape[-1] + 31) // 32), dtype=torch.int32)


@_op("unpack_mask(Tensor words, int num_keys, str backend) -> Tensor")
def unpack_mask(words, num_keys, backend):
    return BODIES['unpack_mask'](words, num_keys, backend).contiguous()


@_fake("unpack_mask")
def _(words, num_keys, backend):
    return words.new_empty((*words.shape[:-1], num_keys), dtype=torch.bool)


@_op("tree_mask(Tensor parents, str backend) -> (Tensor, Tensor)")
def tree_mask(parents, backend):
    return _fresh(*BODIES['tree_mask'](parents, backend))


@_fake("tree_mask")
def _(parents, backend):
    batch, nodes = parents.shape
    return (
        parents.new_empty((batch, nodes, (nodes + 31) // 32), dtype=torch.int32),
        parents.new_empty((batch, nodes), dtype=torch.int64),
    )


@_op(
    "cascade_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? prefix_k, Tensor? prefix_v, "
    "Tensor? prefix_indptr, Tensor? prefix_page_table, Tensor? prefix_lens, float? sm_scale, "
    "bool return_lse, int? max_prefix_len, str backend) -> (Tensor, Tensor)"
)
def cascade_attention(
    q,
    k,
    v,
    mask,
    prefix_k,
    prefix_v,
    prefix_indptr,
    prefix_page_table,
    prefix_lens,
    sm_scale,
    return_lse,
    max_prefix_len,
    backend,
):
    result = BODIES['cascade_attention'](
        q,
        k,
        v,
        mask,
        prefix_k,
        prefix_v,
        prefix_indptr,
        prefix_page_table,
        prefix_lens,
        sm_scale,
        return_lse,
        max_prefix_len,
        backend,
    )
    if return_lse:
        return _fresh(*result)
    return _fresh(result, q.new_empty((0,), dtype=torch.float32))


@_fake("cascade_attention")
def _(
    q,
    k,
    v,
    mask,
    prefix_k,
    prefix_v,
    prefix_indptr,
    prefix_page_table,
    prefix_lens,
    sm_scale,
    return_lse,
    max_prefix_len,
    backend,
):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(lse_shape, dtype=torch.float32)


@_op("merge_states(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b, str backend) -> (Tensor, Tensor)")
def merge_states(o_a, lse_a, o_b, lse_b, backend):
    return _fresh(*BODIES['merge_states'](o_a, lse_a, o_b, lse_b, backend))


@_fake("merge_states")
def _(o_a, lse_a, o_b, lse_b, backend):
    return (
        torch.empty_like(o_a, memory_format=torch.contiguous_format),
        torch.empty_like(lse_a, dtype=torch.float32, memory_format=torch.contiguous_format),
    )


OPS = tuple(IMPLS)

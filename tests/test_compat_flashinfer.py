"""dspec.compat.flashinfer: flashinfer's own test cases for its four calls, on dspec's ops.

The cases, shapes and tolerances follow flashinfer's tests of ``chain_speculative_sampling``
(tests/utils/test_sampling.py), ``merge_state_in_place`` with a mask
(tests/attention/test_shared_prefix_kernels.py) and ``merge_state`` / ``merge_states``
(tests/utils/test_triton_cascade.py, tests/trace/*merge_state*), re-expressed here; the
statistical checks and the direct-softmax references are this project's.
"""

from __future__ import annotations

import math

import pytest
import torch

import dspec
from dspec.compat import flashinfer as fi

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------
# chain_speculative_sampling
# ---------------------------------------------------------------------------------------


def _normalised(*shape, device, gen):
    x = torch.rand(*shape, generator=gen, device=device)
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("onehot_target", [False, True])
@pytest.mark.parametrize("num_speculate_tokens", [1, 3, 5, 7])
@pytest.mark.parametrize("batch_size,vocab_size", [(1, 111), (99, 111), (1, 32000), (99, 4096)])
def test_chain_speculative_sampling_outputs_are_well_formed(
    batch_size, vocab_size, num_speculate_tokens, onehot_target, device
):
    gen = torch.Generator(device=device).manual_seed(batch_size * 1000 + vocab_size + num_speculate_tokens)
    b, n, v = batch_size, num_speculate_tokens, vocab_size
    draft_probs = _normalised(b, n, v, device=device, gen=gen)
    draft_ids = torch.randint(v, (b, n), generator=gen, device=device)  # int64, as theirs
    if onehot_target:
        target_ids = torch.randint(v, (b, n + 1), generator=gen, device=device)
        target_ids[:, :n] = draft_ids
        target_probs = torch.zeros(b, n + 1, v, device=device)
        target_probs.scatter_(2, target_ids.unsqueeze(-1), 1.0)
    else:
        target_probs = _normalised(b, n + 1, v, device=device, gen=gen)
    for _ in range(10):
        accepted = torch.zeros(b, dtype=torch.int32, device=device)
        emitted = torch.zeros(b, dtype=torch.int32, device=device)
        out, accepted, emitted = fi.chain_speculative_sampling(
            draft_probs, draft_ids, target_probs, accepted, emitted, generator=gen
        )
        assert out.dtype == torch.int32 and out.shape == (b, n + 1)
        if onehot_target:
            # every draft is the target's only token: all accepted, the bonus is the target's
            assert torch.equal(out, target_ids.int())
            assert torch.equal(emitted, torch.full_like(emitted, n))
            assert torch.equal(accepted, torch.full_like(accepted, n))
        else:
            assert bool((out[out >= 0] < v).all())
            mismatch = out[:, :-1] != draft_ids.int()
            for row in range(b):
                at = mismatch[row].nonzero().flatten()
                if len(at):
                    assert torch.equal(at, torch.arange(int(at[0]), n, device=device)), "contiguous"
                    assert bool((out[row, int(at[0]) + 1 :] == -1).all())
        assert torch.equal((emitted + 1).long(), (out != -1).sum(1))
        assert bool((accepted >= emitted).all()) and bool((accepted <= n).all())


@pytest.mark.parametrize("device", DEVICES)
def test_chain_speculative_sampling_rejects_a_draft_the_target_cannot_emit(device):
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    for seed in range(20):
        out, accepted, emitted = fi.chain_speculative_sampling(draft, ids, target, seed=seed, offset=0)
        # draft 0 has p >= q (always accepted); draft 1 has p = 0; the residual is one-hot on 0
        assert out.tolist() == [[2, 0, -1]]
        assert accepted.tolist() == [1] and emitted.tolist() == [1]
        assert accepted.dtype == emitted.dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
def test_chain_speculative_sampling_adds_to_the_given_counters_in_place(device):
    b, n, v = 5, 3, 7
    onehot = torch.zeros(b, n + 1, v, device=device)
    onehot[..., 2] = 1.0
    ids = torch.full((b, n), 2, dtype=torch.int32, device=device)
    draft = torch.full((b, n, v), 1.0 / v, device=device)
    accepted = torch.full((b,), 10, dtype=torch.int32, device=device)
    emitted = torch.full((b,), 20, dtype=torch.int32, device=device)
    out = fi.chain_speculative_sampling(draft, ids, onehot, accepted, emitted)
    assert out[1] is accepted and out[2] is emitted
    assert accepted.tolist() == [10 + n] * b and emitted.tolist() == [20 + n] * b
    fi.chain_speculative_sampling(draft, ids, onehot, accepted, emitted)
    assert accepted.tolist() == [10 + 2 * n] * b and emitted.tolist() == [20 + 2 * n] * b


def test_chain_speculative_sampling_is_lossless_and_accepts_at_the_expected_rate():
    """Drafts drawn from q: the first emitted token follows p_0 exactly; P(emit >= 1) =
    a_0 = sum(min(p_0, q_0)); the accepted count (the accepted prefix, then a fresh test of
    every draft from the rejected one on) has its exact mean: with r_i = min(1, p_i / q_i),
    A_k = prod_{j<k} a_j and b_k = E_q[r_k (1 - r_k)] (a rejected draft passing its fresh
    test), E = sum_k A_k a_k + sum_k A_k (b_k + (1 - a_k) sum_{i>k} a_i)."""
    gen = torch.Generator().manual_seed(0)
    rows, n, v = 40000, 2, 6
    q = _normalised(n, v, device="cpu", gen=gen)
    p = _normalised(n + 1, v, device="cpu", gen=gen)
    draft_ids = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=gen) for i in range(n)], dim=1)
    out, accepted, emitted = fi.chain_speculative_sampling(
        q.expand(rows, n, v), draft_ids, p.expand(rows, n + 1, v), generator=gen
    )
    freq = torch.bincount(out[:, 0].long(), minlength=v).double() / rows
    sigma = (p[0].double() * (1 - p[0].double()) / rows).sqrt()
    assert bool(((freq - p[0].double()).abs() <= 5 * sigma + 1e-4).all()), (freq, p[0])
    overlap = torch.minimum(p[:n], q).sum(-1).double()
    rate = (emitted >= 1).double().mean()
    assert abs(rate - overlap[0]) <= 5 * math.sqrt(overlap[0] * (1 - overlap[0]) / rows)
    r = torch.clamp(p[:n] / q, max=1.0).double()
    b_rejected_passes = (q.double() * r * (1 - r)).sum(-1)
    expected, reach = 0.0, 1.0
    for k in range(n):
        expected += reach * (overlap[k] + b_rejected_passes[k] + (1 - overlap[k]) * overlap[k + 1 :].sum())
        reach *= float(overlap[k])
    mean = accepted.double().mean()
    assert abs(mean - expected) <= 5 * math.sqrt(n * n / (4 * rows)), (mean, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_chain_speculative_sampling_seed_and_offset_are_reproducible(device):
    gen = torch.Generator(device=device).manual_seed(3)
    b, n, v = 64, 4, 50
    draft = _normalised(b, n, v, device=device, gen=gen)
    target = _normalised(b, n + 1, v, device=device, gen=gen)
    ids = torch.randint(v, (b, n), generator=gen, device=device, dtype=torch.int32)
    first = fi.chain_speculative_sampling(draft, ids, target, seed=7, offset=11)
    again = fi.chain_speculative_sampling(draft, ids, target, seed=7, offset=11)
    moved = fi.chain_speculative_sampling(draft, ids, target, seed=7, offset=12)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    assert not torch.equal(first[0], moved[0])
    as_tensors = fi.chain_speculative_sampling(
        draft, ids, target, seed=torch.tensor([7], device=device), offset=torch.tensor([11], device=device)
    )
    assert torch.equal(as_tensors[0], first[0])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda d, i, t: fi.chain_speculative_sampling(d, i[:, :2], t), "draft_token_ids"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i, t[:, :3]), "target_probs"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i.float(), t), "draft_token_ids"),
        (lambda d, i, t: fi.chain_speculative_sampling(d[0], i, t), "draft_probs"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i + 100, t), "draft_token_ids"),
        (lambda d, i, t: fi.chain_speculative_sampling(d * 20, i, t), "draft_probs"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i, -t), "target_probs"),
        (
            lambda d, i, t: fi.chain_speculative_sampling(d, i, t, torch.zeros(3, dtype=torch.int32)),
            "maybe_output_accepted_token_num",
        ),
        (
            lambda d, i, t: fi.chain_speculative_sampling(d, i, t, None, torch.zeros(2)),
            "maybe_output_emitted_draft_token_num",
        ),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i, t, generator=3), "generator"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i, t, deterministic="yes"), "deterministic"),
        (lambda d, i, t: fi.chain_speculative_sampling(d, i, t, seed=1, offset=torch.tensor([1])), "seed"),
        (
            lambda d, i, t: fi.chain_speculative_sampling(
                d, i, t, seed=torch.tensor([1], dtype=torch.int32), offset=torch.tensor([1], dtype=torch.int32)
            ),
            "seed",
        ),
        (
            lambda d, i, t: fi.chain_speculative_sampling(
                d, i, t, seed=torch.tensor([1, 2, 3]), offset=torch.tensor([1])
            ),
            "seed",
        ),
    ],
)
def test_chain_speculative_sampling_rejects_bad_input_naming_it(call, match):
    d = torch.full((2, 3, 10), 0.1)
    i = torch.zeros(2, 3, dtype=torch.int32)
    t = torch.full((2, 4, 10), 0.1)
    with pytest.raises(ValueError, match=match):
        call(d, i, t)


# ---------------------------------------------------------------------------------------
# merge_state / merge_state_in_place / merge_states (base-2 log-sum-exp)
# ---------------------------------------------------------------------------------------


def _attend(q, k, v):
    """Per query and head: (softmax(q.k / sqrt(D)) @ v, base-2 lse) in float64.
    q [n, H, D], k/v [m, H, D] -> out [n, H, D], lse2 [n, H]."""
    scores = torch.einsum("nhd,mhd->nhm", q.double(), k.double()) / math.sqrt(q.shape[-1])
    out = torch.einsum("nhm,mhd->nhd", torch.softmax(scores, -1), v.double())
    return out, torch.logsumexp(scores, -1) / math.log(2.0)


def _reference_merge(v, s):
    """Direct float64 merge of states v [n, S, H, D], s [n, S, H] (base 2)."""
    total = torch.logsumexp(s.double() * math.log(2.0), dim=1)  # natural
    w = torch.exp(s.double() * math.log(2.0) - total[:, None])
    return (w[..., None] * v.double()).sum(1), total / math.log(2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_merge_state_equals_attention_over_the_concatenated_keys(dtype, tol, device):
    gen = torch.Generator().manual_seed(1)
    n, heads, dim, ma, mb = 9, 4, 32, 13, 21
    q, k, v = (torch.randn(n if i == 0 else ma + mb, heads, dim, generator=gen) for i in range(3))
    full_out, full_lse = _attend(q, k, v)
    out_a, lse_a = _attend(q, k[:ma], v[:ma])
    out_b, lse_b = _attend(q, k[ma:], v[ma:])
    to = dict(device=device)
    merged, lse = fi.merge_state(
        out_a.to(dtype=dtype, **to), lse_a.float().to(**to), out_b.to(dtype=dtype, **to), lse_b.float().to(**to)
    )
    assert merged.dtype == dtype and lse.dtype == torch.float32
    assert merged.shape == (n, heads, dim) and lse.shape == (n, heads)
    torch.testing.assert_close(merged.double().cpu(), full_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), full_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_random_states(device):
    gen = torch.Generator().manual_seed(2)
    seq_len, heads, dim = 2048, 32, 128
    va, vb = (torch.randn(seq_len, heads, dim, generator=gen).half().to(device) for _ in range(2))
    sa, sb = (torch.randn(seq_len, heads, generator=gen).to(device) for _ in range(2))
    v, s = fi.merge_state(va, sa, vb, sb)
    ref_v, ref_s = _reference_merge(torch.stack([va, vb], 1).cpu(), torch.stack([sa, sb], 1).cpu())
    torch.testing.assert_close(v.double().cpu(), ref_v, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s.double().cpu(), ref_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_of_empty_states(device):
    v = torch.randn(3, 2, 8, device=device)
    empty = torch.full((3, 2), -math.inf, device=device)
    out, s = fi.merge_state(v, empty, v.clone(), empty.clone())
    assert torch.equal(out, torch.zeros_like(v)) and bool(torch.isneginf(s).all())
    out, s = fi.merge_state(v, empty, v * 2, torch.zeros(3, 2, device=device))
    torch.testing.assert_close(out, v * 2)
    assert torch.equal(s, torch.zeros(3, 2, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_in_place_with_mask(device):
    gen = torch.Generator().manual_seed(0)
    seq_len, heads, dim = 512, 32, 128
    va = torch.randn(seq_len, heads, dim, generator=gen).half().to(device)
    sa = torch.randn(seq_len, heads, generator=gen).to(device)
    vb = torch.randn(seq_len, heads, dim, generator=gen).half().to(device)
    sb = torch.randn(seq_len, heads, generator=gen).to(device)
    va0, sa0 = va.clone(), sa.clone()

    assert fi.merge_state_in_place(va, sa, vb, sb) is None
    ref_v, ref_s = va.clone(), sa.clone()
    assert not torch.allclose(ref_v, va0) and not torch.allclose(ref_s, sa0)
    want_v, want_s = fi.merge_state(va0, sa0, vb, sb)
    assert torch.equal(ref_v, want_v) and torch.equal(ref_s, want_s)

    for mask, expect in (
        (torch.ones(seq_len, dtype=torch.bool), (ref_v, ref_s)),
        (torch.zeros(seq_len, dtype=torch.bool), (va0, sa0)),
        (torch.ones(seq_len, dtype=torch.uint8), (ref_v, ref_s)),
    ):
        v, s = va0.clone(), sa0.clone()
        fi.merge_state_in_place(v, s, vb, sb, mask=mask.to(device))
        torch.testing.assert_close(v, expect[0], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(s, expect[1], rtol=1e-3, atol=1e-3)

    mask_gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        mask = (torch.rand(seq_len, generator=mask_gen) > 0.5).to(device)
        v, s = va0.clone(), sa0.clone()
        fi.merge_state_in_place(v, s, vb, sb, mask=mask)
        assert torch.equal(v[~mask], va0[~mask]) and torch.equal(s[~mask], sa0[~mask])
        torch.testing.assert_close(v[mask], ref_v[mask], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(s[mask], ref_s[mask], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seq_len,num_states,num_heads,head_dim", [(16, 3, 4, 64), (7, 2, 2, 64), (64, 100, 4, 64), (5, 1, 2, 8)]
)
def test_merge_states_against_a_direct_merge(seq_len, num_states, num_heads, head_dim, device):
    gen = torch.Generator().manual_seed(seq_len + num_states)
    v = torch.randn(seq_len, num_states, num_heads, head_dim, generator=gen).half()
    s = torch.randn(seq_len, num_states, num_heads, generator=gen)
    out, lse = fi.merge_states(v.to(device), s.to(device))
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert out.shape == (seq_len, num_heads, head_dim) and lse.shape == (seq_len, num_heads)
    ref_v, ref_s = _reference_merge(v, s)
    torch.testing.assert_close(out.double().cpu(), ref_v, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse.double().cpu(), ref_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_equals_attention_over_all_the_keys(device):
    gen = torch.Generator().manual_seed(4)
    n, heads, dim, bounds = 6, 3, 16, [0, 5, 6, 17, 30, 31]
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(bounds[-1], heads, dim, generator=gen) for _ in range(2))
    parts = [_attend(q, k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]
    vs = torch.stack([o for o, _ in parts], 1).float().to(device)
    ss = torch.stack([s for _, s in parts], 1).float().to(device)
    out, lse = fi.merge_states(vs, ss)
    full_out, full_lse = _attend(q, k, v)
    torch.testing.assert_close(out.double().cpu(), full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), full_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_of_empty_and_no_states(device):
    v = torch.randn(4, 3, 2, 8, device=device)
    out, lse = fi.merge_states(v, torch.full((4, 3, 2), -math.inf, device=device))
    assert torch.equal(out, torch.zeros(4, 2, 8, device=device)) and bool(torch.isneginf(lse).all())
    out, lse = fi.merge_states(v[:, :0], torch.zeros(4, 0, 2, device=device))
    assert torch.equal(out, torch.zeros(4, 2, 8, device=device)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda v, s: fi.merge_state(v, s, v[:2], s[:2]), "v_b"),
        (lambda v, s: fi.merge_state(v, s[:, :1], v, s), "s_a"),
        (lambda v, s: fi.merge_state(v, s, v.half(), s), "v_b"),
        (lambda v, s: fi.merge_state(v.int(), s, v, s), "v_a"),
        (lambda v, s: fi.merge_state(v, s, v, s.int()), "s_b"),
        (lambda v, s: fi.merge_state_in_place(v, s.half(), v, s), "s"),
        (lambda v, s: fi.merge_state_in_place(v, s, v, s, mask=torch.ones(2, dtype=torch.bool)), "mask"),
        (lambda v, s: fi.merge_state_in_place(v, s, v, s, mask=torch.ones(3)), "mask"),
        (lambda v, s: fi.merge_state_in_place(v, s, v[..., :4], s), "v_other"),
        (lambda v, s: fi.merge_states(v, s), "v"),
        (lambda v, s: fi.merge_states(v[:, None], s), "s"),
    ],
)
def test_merge_calls_reject_bad_input_naming_it(call, match):
    v, s = torch.randn(3, 2, 8), torch.randn(3, 2)
    with pytest.raises(ValueError, match=rf"\b{match}\b"):
        call(v, s)


def test_merge_state_agrees_with_dspec_merge_states_in_natural_log():
    gen = torch.Generator().manual_seed(5)
    va, vb = torch.randn(2, 4, 3, 16, generator=gen)
    sa, sb = torch.randn(2, 4, 3, generator=gen)
    v, s = fi.merge_state(va, sa, vb, sb)
    o, lse = dspec.merge_states(va, sa * math.log(2.0), vb, sb * math.log(2.0))
    torch.testing.assert_close(v, o)
    torch.testing.assert_close(s * math.log(2.0), lse)

"""dspec._C.decoder_layers (every layer of an inference forward in one call, models/stack.py)
against the per-op path of transformer.py: logits, suffix keys / values and hidden states
bit for bit, with and without a cached prefix, masks, batches, a mask adapter; and
dspec._C.silu_mul against torch's F.silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dspec
from dspec import _backend
from dspec.models import AttentionPlan, stack
from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not _backend.cpp_available(), reason="dspec._C not built"),
    # the stack runs the packed projections, which dspec takes only where it has SIMD tiles
    pytest.mark.skipif(
        _backend.cpp_available() and _backend.extension().linear_isa(0) == "generic",
        reason="no SIMD projection tiles on this CPU (or under DSPEC_CPU_ISA=generic)",
    ),
]
MASK = 5


@pytest.fixture(scope="module")
def base32(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)
    return dspec.load(path, dtype="float32")


@pytest.fixture(scope="module")
def bd(base32):
    return trained_looking_mask_adapter(base32, mask_token_id=MASK)


def _ids(n, seed, lo=10, hi=150):
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _both(monkeypatch, fn):
    """fn() through the one-call stack, then through the per-op path."""
    calls = []
    real = stack.run_layers

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("dspec.models.transformer.run_layers", spy)
    with torch.no_grad():  # as every decode loop runs
        fused = fn()
        assert calls and all(calls), "the one-call stack did not run"
        monkeypatch.setattr(stack, "ENABLED", False)
        per_op = fn()
    monkeypatch.setattr(stack, "ENABLED", True)
    return fused, per_op


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_per_op_path(base32, tmp_path, monkeypatch, dtype):
    # (Model.to converts in place: a bf16 copy of the module's model is loaded afresh)
    model = base32 if dtype == "float32" else dspec.load(write_checkpoint(tmp_path, "llama", seed=3), dtype=dtype)
    seqs = [_ids(9, 1), _ids(5, 2), _ids(7, 3)]
    cache = model.new_cache(3)
    with torch.no_grad():
        prompt = model(model.plan(seqs, cache))
    cache.append(prompt.suffix_kv, counts=torch.tensor([len(s) for s in seqs]))
    nxt = [_ids(4, 4), _ids(4, 5), _ids(4, 6)]

    def step():
        out = model(model.plan(nxt, cache), logits="all", hidden_states=[0, 1, -1])
        return out.logits, out.hidden, out.suffix_kv.keys, out.suffix_kv.values

    fused, per_op = _both(monkeypatch, step)
    _equal(fused, per_op)
    # no prefix, one row
    fused, per_op = _both(monkeypatch, lambda: model(model.plan([[11]]), logits="all").logits)
    _equal(fused, per_op)


def test_stack_with_mask_adapter_and_masks(bd, monkeypatch):
    seqs = [_ids(6, 7) + [MASK, 60, MASK, MASK], _ids(6, 8) + [MASK] * 4]
    fused, per_op = _both(
        monkeypatch, lambda: bd(bd.plan(seqs, attention="block_causal", block_size=4), logits="all").logits
    )
    _equal(fused, per_op)


def test_a_bf16_valued_adapter_is_read_in_bf16_with_the_same_bits(base32, monkeypatch):
    """An adapter whose values are all bf16 numbers (the shipped one) is streamed in bf16 by
    the stack and the per-op path; the logits equal those of its float32 copy bit for bit."""
    from dspec.models.mask_adapter import MaskLoraLinear

    bd16 = trained_looking_mask_adapter(base32, mask_token_id=MASK, seed=1)
    with torch.no_grad():
        for name, p in bd16.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(p.bfloat16().float())
    adapted = [m for m in bd16.modules() if type(m) is MaskLoraLinear]
    assert all(m.lora_operands()[0].dtype is torch.bfloat16 for m in adapted)
    seqs = [_ids(6, 7) + [MASK, 60, MASK, MASK], _ids(6, 8) + [MASK] * 4]
    run = lambda: bd16(bd16.plan(seqs, attention="block_causal", block_size=4), logits="all").logits
    fused, per_op = _both(monkeypatch, run)
    assert stack.weight_table(bd16).lora_dtype == 2
    real = MaskLoraLinear.lora_operands
    monkeypatch.setattr(MaskLoraLinear, "lora_operands", lambda self, float32=False: real(self, float32=True))
    bd16.__dict__.pop("_stack_table", None)
    fused32, per_op32 = _both(monkeypatch, run)
    assert stack.weight_table(bd16).lora_dtype == 0
    _equal(fused, fused32)
    _equal(per_op, per_op32)
    _equal(fused, per_op)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_model_with_a_bf16_adapter_takes_the_packed_update(tmp_path, monkeypatch, threads):
    """A bf16 model with a bf16-valued adapter: where mask_lora's AMX code runs, the stack and
    the per-op path both read the packed adapter, with the same bits -- also when the stack
    gives the q / k / v and gate / up updates to two threads (threads 2), and for more than
    16 [MASK] rows (two row groups)."""
    from dspec.models.mask_adapter import MaskLoraLinear

    base16 = dspec.load(write_checkpoint(tmp_path, "llama", seed=3), dtype="bfloat16")
    bd16 = trained_looking_mask_adapter(base16, mask_token_id=MASK, seed=4)
    with torch.no_grad():
        for name, p in bd16.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(p.bfloat16().float())
    amx = _backend.extension().mask_lora_has_amx(_backend.FLOAT_CODE[torch.bfloat16], 4)
    adapted = [m for m in bd16.modules() if type(m) is MaskLoraLinear]
    assert all((m.lora_packed() is not None) == amx for m in adapted)
    seqs = [_ids(6, 7) + [MASK, 60, MASK, MASK], _ids(2, 8) + [MASK] * 8, [MASK] * 12]
    run = lambda: bd16(bd16.plan(seqs, attention="block_causal", block_size=4), logits="all").logits
    torch.set_num_threads(threads)
    fused, per_op = _both(monkeypatch, run)
    assert (
        all(p != 0 for p, a in zip(stack.weight_table(bd16).lora_packed, stack.weight_table(bd16).lora[::2]) if a)
        == amx
    )
    _equal(fused, per_op)


def test_a_strided_adapter_runs_fused_with_the_same_bits(tmp_path, monkeypatch):
    """LoRA matrices that are views with any strides (a transposed lora_B, as a loader may
    leave it) still take the one-call stack and dspec._C.mask_lora -- both read contiguous
    copies -- and give the logits of the contiguous adapter."""
    from dspec.models.mask_adapter import MaskLoraLinear

    base = dspec.load(write_checkpoint(tmp_path, "llama", seed=3), dtype="float32")
    bd = trained_looking_mask_adapter(base, mask_token_id=MASK, seed=2)
    seqs = [_ids(6, 9) + [MASK, 61, MASK, MASK], _ids(5, 10) + [MASK] * 4]
    run = lambda: bd(bd.plan(seqs, attention="block_causal", block_size=4), logits="all").logits
    with torch.no_grad():
        want = run()
        for m in bd.modules():
            if type(m) is MaskLoraLinear:
                m.lora_B = torch.nn.Parameter(m.lora_B.detach().t().contiguous().t())
                assert not m.lora_B.is_contiguous()
    bd.__dict__.pop("_stack_table", None)
    adapted = next(m for m in bd.modules() if type(m) is MaskLoraLinear)
    x = torch.randn(8, adapted.in_features)
    with torch.no_grad():
        assert adapted.fused_update(x, torch.zeros(8, adapted.out_features), torch.tensor([1, 5]))
    fused, per_op = _both(monkeypatch, run)
    assert stack.weight_table(bd) is not None
    _equal(fused, want)
    _equal(per_op, want)


def test_stack_equals_transformers_within_tolerance(base32, monkeypatch):
    """The stack's own accuracy, not only its agreement with the per-op path."""
    seq = _ids(12, 9)
    fused, per_op = _both(monkeypatch, lambda: base32(base32.plan([seq]), logits="all").logits)
    torch.testing.assert_close(fused, per_op, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, width", [(torch.float32, 37), (torch.bfloat16, 100), (torch.float16, 17)])
def test_silu_mul_matches_torch(dtype, width):
    g = torch.Generator().manual_seed(width)
    gate = (torch.randn(5, width, generator=g) * 6).to(dtype)
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    up = torch.randn(5, width, generator=g).to(dtype)
    out = torch.empty_like(gate)
    _backend.extension().silu_mul(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), _backend.FLOAT_CODE[dtype], 5, width, 2
    )
    want = F.silu(gate.float()).to(dtype).float() * up.float()
    # one rounding of the dtype off torch's at most (a different exp polynomial)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), want.to(dtype).float(), rtol=tol, atol=tol)


def test_decoder_layers_rejects_bad_arguments():
    ext = _backend.extension()
    args = dict(
        x=1 << 12,
        dtype=0,
        batch=1,
        n=1,
        hidden=8,
        hq=2,
        hkv=1,
        head_dim=4,
        intermediate=16,
        eps=1e-5,
        cos=1 << 12,
        sin=1 << 12,
        mask=0,
        mask_s0=0,
        mask_s1=0,
        prefix_k=0,
        prefix_v=0,
        prefix_indptr=0,
        indptr_dtype=0,
        page_table=0,
        prefix_lens=0,
        prefix_rows=0,
        page_size=1,
        max_pages=0,
        page_table_stride=0,
        prefix_k_s0=0,
        prefix_k_s1=0,
        prefix_k_s2=0,
        prefix_v_s0=0,
        prefix_v_s1=0,
        prefix_v_s2=0,
        prefix_layer_stride=0,
        sm_scale=0.5,
        weights=[1 << 12] * 16,
        lora=[],
        lora_scales=[],
        lora_rank=0,
        mask_rows=0,
        num_mask_rows=0,
        k_out=1 << 12,
        v_out=1 << 12,
        hidden_out=0,
        hidden_slots=0,
        record=[-1],
        num_threads=1,
    )
    for key, bad, match in (
        ("weights", [1 << 12] * 15, "weights must hold 16"),
        ("head_dim", 5, "head_dim"),
        ("record", [-1, -1], "record must hold"),
        ("record", [0], r"record\[0\]"),
        ("eps", 0.0, "eps"),
        ("hkv", 3, "multiple of hkv"),
        ("num_mask_rows", 1, "mask_rows without lora"),
    ):
        with pytest.raises(ValueError, match=match):
            ext.decoder_layers(**dict(args, **{key: bad}))


def test_frozen_weights_checks_the_table_once_and_nests(tmp_path, monkeypatch):
    """Inside frozen_weights the weight table is validated once, not per forward; outside,
    a weight changed in place between decode calls is seen (the stack still equals the
    per-op path)."""
    from dspec.decode.ar import decode_ar

    model = dspec.load(write_checkpoint(tmp_path, "llama", seed=5), dtype="float32")
    prompts = [_ids(5, 1)]
    calls = []
    real = stack.params_state
    monkeypatch.setattr(stack, "params_state", lambda params: calls.append(1) or real(params))
    ref, _ = decode_ar(model, prompts, max_new_tokens=6)
    per_forward = len(calls)
    calls.clear()
    with stack.frozen_weights(model):
        with stack.frozen_weights(model):
            inner, _ = decode_ar(model, prompts, max_new_tokens=6)
        assert model.__dict__["_stack_frozen"][0] == 1
        again, _ = decode_ar(model, prompts, max_new_tokens=6)
    assert "_stack_frozen" not in model.__dict__
    assert inner == again == ref and len(calls) <= 2 < per_forward
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-3.0)  # in place: the table must notice
    with stack.frozen_weights(model):
        changed, _ = decode_ar(model, prompts, max_new_tokens=6)
    monkeypatch.setattr(stack, "ENABLED", False)
    per_op, _ = decode_ar(model, prompts, max_new_tokens=6)
    assert changed == per_op
    with stack.frozen_weights(object()):  # not a dspec model: no-op
        pass


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chain_forward_rows_equal_one_token_steps(tmp_path, family, dtype):
    """The model-level invariance speculative decoding relies on: N tokens verified in one
    forward after a cached prefix give, row for row and bit for bit, the logits of N
    one-token forwards (prefix lengths across key tiles and chunks; the stacked layers for
    llama, the per-op path for qwen3's qk-norm)."""
    model = dspec.load(write_checkpoint(tmp_path, family, seed=7), dtype=dtype)
    for plen, n in ((3, 5), (70, 12), (260, 9)):
        prompt, chain = _ids(plen, plen), _ids(n, plen + 1)
        with torch.no_grad():
            c1, c2 = model.new_cache(1), model.new_cache(1)
            for c in (c1, c2):
                plan = model.plan([prompt], c)
                c.append(model(plan, logits=None).suffix_kv, counts=plan.lengths)
            steps = []
            for t in chain:
                out = model(model.plan([[t]], c1))
                c1.append(out.suffix_kv, counts=[1])
                steps.append(out.logits[0, 0])
            whole = model(model.plan([chain], c2)).logits[0]
        for i in range(n):
            assert torch.equal(steps[i], whole[i]), (plen, i)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_bits_do_not_depend_on_how_the_prompt_is_cut(tmp_path, family, dtype):
    """A long prompt prefilled in one forward (``ar``) or in pieces (the block-diffusion
    methods commit whole blocks, then forward the rest with the first block) leaves the same
    cached keys and values and the same next-token logits, bit for bit, in bf16 too: every
    row count takes the packed projections (``dense.PACKED_MAX_ROWS``)."""
    # wide enough that a library GEMM's rows round differently from the packed kernel's
    model = dspec.load(write_checkpoint(tmp_path, family, seed=3, hidden=256, inter=768), dtype=dtype)
    prompt = _ids(203, 11)
    with torch.no_grad():
        whole, cut = model.new_cache(1), model.new_cache(1)
        plan = model.plan([prompt], whole)
        last_whole = model(plan, logits="last")
        whole.append(last_whole.suffix_kv, counts=plan.lengths)
        for lo, hi in ((0, 200), (200, 203)):
            plan = model.plan([prompt[lo:hi]], cut)
            last_cut = model(plan, logits="last")
            cut.append(last_cut.suffix_kv, counts=plan.lengths)
    assert torch.equal(last_whole.logits, last_cut.logits)
    for layer in (0, model.config.num_layers - 1):
        for a, b in zip(whole.layer_rows(layer), cut.layer_rows(layer)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tree_forward_rows_equal_their_chains(tmp_path, family, dtype):
    """A draft tree verified in one forward gives each node, bit for bit, the logits of the
    chain forward of its path (the one-token steps that decode it, by the chain test above):
    tree layouts are as exact as chains in bf16 (the attention compacts a node's keys)."""
    model = dspec.load(write_checkpoint(tmp_path, family, seed=5, hidden=256, inter=768), dtype=dtype)
    prompt = _ids(70, 4)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, 0]
    nodes = _ids(len(parents), 9)
    mask = dspec.masks.tree(torch.tensor(parents))
    with torch.no_grad():
        cache = model.new_cache(1)
        plan = model.plan([prompt], cache)
        cache.append(model(plan, logits=None).suffix_kv, counts=plan.lengths)
        tree = model(AttentionPlan.from_offsets(torch.tensor([nodes]), mask.positions, mask.words, cache)).logits[0]
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.insert(0, nodes[j])
                j = parents[j]
            chain = model(model.plan([path], cache)).logits[0, -1]
            assert torch.equal(chain, tree[i]), i

"""S2D2's compiled step (dspec._C.s2d2_*) against its torch composition: the same forward
inputs every step (suffix tokens, positions, mask words, logit rows), the same row state
after every step, and the same outputs and stats."""

import pytest
import torch

import dspec
from dspec import _backend
from dspec.decode import s2d2
from selfspec_cases import tiny, weak_context
from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

ext = _backend.extension()
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(ext is None or not hasattr(ext, "s2d2_plan"), reason="dspec._C without the s2d2 ops"),
]

MASK = 5


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2", "clean_causal"])
def model(request, tmp_path_factory):
    if request.param == "clean_causal":  # right-shifted, clean rows causal: shared-prefix redraft blocks
        base = dspec.load(
            write_checkpoint(
                tmp_path_factory.mktemp("llama_s2d2"), "llama", seed=3, vocab=64, weights_hook=weak_context
            )
        )
        model = trained_looking_mask_adapter(base, mask_token_id=MASK)
        assert model.config.clean_causal and model.shifted
        return model
    return tiny(tmp_path_factory, request.param, weights_hook=weak_context)


class Recorder:
    """The model, recording every forward's inputs."""

    def __init__(self, model):
        self.inner, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, plan, **kw):
        rows = kw.get("logits")
        self.calls.append(
            (
                plan.tokens.clone(),
                plan.positions.clone(),
                plan.mask.clone(),
                rows if isinstance(rows, str) else rows.clone(),
                kw.get("return_kv"),
            )
        )
        return self.inner(plan, **kw)


def batches(model, prompts, *, max_new_tokens, **options):
    opt = s2d2.resolve_options(
        model,
        options.get("block_size"),
        None,
        "always",
        None,
        None,
        None,
        None,
        None,
        options.get("draft_len"),
        options.get("redraft", True),
        batch=len(prompts),
        boundary=options.get("boundary"),
    )
    kw = dict(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        generator=None,
        eos_ids=options.get("eos_ids", model.eos_token_ids),
        progress=None,
    )
    native = s2d2.S2D2Run(Recorder(model), prompts, opt, **kw)
    torch_path = s2d2.S2D2Run(Recorder(model), prompts, opt, **kw)
    torch_path.native = None
    assert native.native is not None
    return native, torch_path


def assert_same_state(native, torch_path):
    """The native records hold the torch step's row state (spans only where they are live)."""
    st, bs = native.nat.state, native.bs
    f = ext.s2d2_record_layout(bs)
    assert torch.equal(st[:, f["phase"]], torch_path.phase)
    assert torch.equal(st[:, f["block_start"]], torch_path.block_start)
    assert torch.equal(st[:, f["pending"]].bool(), torch_path.pending)
    assert torch.equal(st[:, f["tokens"] : f["tokens"] + bs], torch_path.tokens)
    assert torch.equal(st[:, f["masked"] : f["masked"] + bs].bool(), torch_path.masked)
    verify = torch_path.phase == s2d2.VERIFY
    for name, ref in (
        ("span_start", torch_path.span_start),
        ("span_len", torch_path.span_len),
        ("exact_first", torch_path.exact_first.long()),
    ):
        assert torch.equal(st[verify, f[name]], ref[verify])
    n = torch_path.span_len
    live = verify[:, None] & (torch.arange(bs)[None] < n[:, None])
    assert torch.equal(st[:, f["drafts"] : f["drafts"] + bs][live], torch_path.drafts[live])
    if torch_path.shifted:  # the carry: the argmax of the torch step's carry logits
        drafting = torch_path.phase == s2d2.DRAFT
        assert torch.equal(st[drafting, f["carry"]], torch_path.carry[drafting].argmax(-1))


@pytest.mark.parametrize(
    "block_size, draft_len, redraft",
    [(4, None, True), (4, None, False), (4, 2, True), (2, None, True), (8, None, True), (5, 3, False)],
)
@pytest.mark.parametrize("boundary", [None, True])
def test_every_step_equals_the_torch_composition(model, block_size, draft_len, redraft, boundary):
    applies = redraft and model.shifted and bool(model.config.clean_causal)
    if boundary and not applies:
        pytest.skip("the boundary state needs redraft blocks, right-shifted, clean rows causal")
    prompts = [[9, 17, 42, 7, 11], [7], [60, 2, 33, 4, 9, 9, 1, 8, 21], [30, 31]]
    a, b = batches(
        model,
        prompts,
        max_new_tokens=23,
        block_size=block_size,
        draft_len=draft_len,
        redraft=redraft,
        boundary=boundary,
    )
    steps = 0
    while True:
        more_a, more_b = a.step(), b.step()
        assert more_a == more_b, steps
        if not more_a:
            break
        steps += 1
        ca, cb = a.model.calls[-1], b.model.calls[-1]
        for name, x, y in zip(("tokens", "positions", "mask", "rows", "return_kv"), ca, cb):
            assert x == y if isinstance(x, (str, bool)) else torch.equal(x, y), (name, steps)
        assert_same_state(a, b)
    assert len(a.model.calls) == len(b.model.calls) and steps > 5
    assert a.generated == b.generated and a.stats() == b.stats()
    stats = a.stats()
    assert stats["verifications"] > 0
    if (block_size, redraft) == (4, True):  # reused redraft blocks and pending blocks were walked
        assert stats["spec_block_drafts"] > 0 and stats["forwards_with"]["commit"] > 0
        # the boundary state (right-shifted, clean rows causal): drafts after a rejected last
        # draft, verified behind the pending block
        assert (stats["boundary_drafts"] > 0) == bool(boundary)


def test_eos_and_ragged_prompts_end_alike(model):
    """Requests ending early (EOS inside a block, a prompt of one token) leave the batch as
    the torch step leaves them."""
    prompts = [[9, 17, 42, 7, 11], [7], [60, 2, 33, 4, 9, 9, 1, 8, 21]]
    _, probe = batches(model, prompts[:1], max_new_tokens=16)
    while probe.step():
        pass
    eos = probe.generated[0][5]  # a token the first request does generate
    a, b = batches(model, prompts, max_new_tokens=30, eos_ids=(eos,))
    while a.step() | b.step():
        pass
    assert a.generated == b.generated and a.stats() == b.stats()
    assert a.generated[0][-1] == eos and len(a.generated[0]) <= 6


def test_decode_uses_the_compiled_step_where_it_applies(model, monkeypatch):
    """decode_s2d2 takes the compiled step for greedy "always" on the CPU and gives the torch
    step's tokens and stats; sampling and the other policies keep the torch step."""
    prompts = [[9, 17, 42, 7, 11], [60, 2, 33]]
    native = s2d2.decode_s2d2(model, prompts, max_new_tokens=20, policy="always")
    monkeypatch.setattr(s2d2, "native_extension", lambda *a: None)
    assert s2d2.decode_s2d2(model, prompts, max_new_tokens=20, policy="always") == native
    assert native[1]["policy"] == "always"
    monkeypatch.undo()
    assert s2d2.native_extension(model, 4, 0.0) is ext
    assert s2d2.native_extension(model, 4, 0.7) is None
    assert s2d2.native_extension(model, ext.s2d2_max_block + 1, 0.0) is None
    for policy, temperature, native in (("always", 0.0, True), ("min_span", 0.0, False), ("always", 0.7, False)):
        opt = s2d2.resolve_options(model, None, None, policy, None, None, None, None, None, None)
        run = s2d2.S2D2Run(
            model,
            prompts,
            opt,
            max_new_tokens=4,
            temperature=temperature,
            generator=torch.Generator().manual_seed(0),
            eos_ids=(),
            progress=None,
        )
        assert (run.native is not None) == native, (policy, temperature)


def _state(rows=1, bs=4):
    return torch.zeros(rows, ext.s2d2_record_layout(bs)["width"], dtype=torch.int64)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("phase", 7, "phase"),
        ("span_start", 4, "span_start"),
        ("span_len", 3, "span_len"),
        ("pending", 2, "flags"),
        ("masked", 2, "masked"),
    ],
)
def test_bad_state_raises_value_error(field, value, match):
    f = ext.s2d2_record_layout(4)
    st = _state()
    st[0, f["phase"]] = s2d2.VERIFY
    st[0, f["span_start"]], st[0, f["span_len"]] = 2, 1
    st[0, f[field]] = value
    buf = torch.zeros(256, dtype=torch.int64)
    words = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        ext.s2d2_plan(st.data_ptr(), 1, 4, 4, MASK, 7, buf.data_ptr(), buf.data_ptr(), words.data_ptr(), buf.data_ptr())


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(rows=0), "rows"),
        (dict(block_size=31), "block_size"),
        (dict(draft_len=5), "draft_len"),
        (dict(mask_id=-1), "mask_id"),
        (dict(flags=16), "flags"),
        (dict(flags=13), "flags"),
        (dict(suffix_ptr=0), "suffix_ptr"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    st = _state()
    buf = torch.zeros(256, dtype=torch.int64)
    words = torch.zeros(256, dtype=torch.int32)
    kw = dict(
        state_ptr=st.data_ptr(),
        rows=1,
        block_size=4,
        draft_len=4,
        mask_id=MASK,
        flags=7,
        suffix_ptr=buf.data_ptr(),
        positions_ptr=buf.data_ptr(),
        words_ptr=words.data_ptr(),
        logit_rows_ptr=buf.data_ptr(),
    )
    kw.update(args)
    with pytest.raises(ValueError, match=match):
        ext.s2d2_plan(**kw)
    with pytest.raises(ValueError, match="logit_rows"):
        ext.s2d2_advance(
            st.data_ptr(),
            1,
            4,
            4,
            MASK,
            7,
            3,
            True,
            False,
            buf.data_ptr(),
            2,
            64,
            64,
            buf.data_ptr(),
            buf.data_ptr(),
            buf.data_ptr(),
        )


def test_advance_reads_only_its_logit_rows():
    """Layout fields of a record (written by s2d2_plan) that index the argmax rows are clamped
    into them: a corrupted record cannot read past the forward's logit rows."""
    f, bs, vocab = ext.s2d2_record_layout(4), 4, 16
    st = _state()
    st[0, f["phase"]], st[0, f["span_start"]], st[0, f["span_len"]] = s2d2.VERIFY, 0, 4
    st[0, f["masked"] : f["masked"] + bs] = 1
    st[0, f["pending"]] = 0
    words = torch.zeros(4096, dtype=torch.int32)
    buf = [torch.zeros(1024, dtype=torch.int64) for _ in range(3)]
    width, nrows, plain, _, any_verify, any_pending = ext.s2d2_plan(
        st.data_ptr(), 1, bs, bs, MASK, 5, buf[0].data_ptr(), buf[1].data_ptr(), words.data_ptr(), buf[2].data_ptr()
    )
    assert not plain and any_verify
    st[0, f["logit_blocks"]] = 10**6
    st[0, f["logit_starts"] : f["logit_starts"] + bs + 1] = -(10**6)
    logits = torch.randn(nrows, vocab)
    argmax, keep = torch.zeros(nrows, dtype=torch.int64), torch.zeros(2 * bs, dtype=torch.int64)
    counters = torch.zeros(32, dtype=torch.int64)
    ext.s2d2_advance(
        st.data_ptr(),
        1,
        bs,
        bs,
        MASK,
        5,
        nrows,
        any_verify,
        any_pending,
        logits.data_ptr(),
        0,
        vocab,
        vocab,
        argmax.data_ptr(),
        keep.data_ptr(),
        counters.data_ptr(),
    )
    assert torch.equal(argmax, logits.argmax(-1))
    assert int(counters[ext.s2d2_counter_layout()["verifications"]]) == 1

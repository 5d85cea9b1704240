"""dspec.hf.custom_generate inside transformers' model.generate: the ids plain generate gives."""

import weakref

import pytest
import torch

import dspec
import dspec.hf

transformers = pytest.importorskip("transformers")


def _hf(name: str):
    path = dspec.load(name).name_or_path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def tiny():
    return _hf("tiny-ar")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return _hf("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))


PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
BATCH = torch.tensor([[2, 2, 2, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17]])
BATCH_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_greedy_equals_generate_tiny(tiny, method):
    ref = tiny.generate(PROMPT, max_new_tokens=16, do_sample=False)
    out = tiny.generate(PROMPT, max_new_tokens=16, do_sample=False, custom_generate=dspec.hf.custom_generate(method))
    assert torch.equal(out, ref)
    ref = tiny.generate(input_ids=BATCH, attention_mask=BATCH_MASK, max_new_tokens=16, do_sample=False)
    out = tiny.generate(
        input_ids=BATCH,
        attention_mask=BATCH_MASK,
        max_new_tokens=16,
        do_sample=False,
        custom_generate=dspec.hf.custom_generate(method),
    )
    assert torch.equal(out, ref)


def test_max_length_and_eos_pad_a_finished_row(tiny):
    # the generation config's EOS ends a row; its tail is pad_token_id, as generate pads it
    ref = tiny.generate(PROMPT, max_new_tokens=16, do_sample=False)
    eos = int(ref[0, PROMPT.shape[1] + 2])
    kw = dict(max_length=PROMPT.shape[1] + 10, do_sample=False, eos_token_id=eos, pad_token_id=3)
    want = tiny.generate(input_ids=torch.cat([PROMPT, PROMPT + 20]), **kw)
    got = tiny.generate(
        input_ids=torch.cat([PROMPT, PROMPT + 20]), custom_generate=dspec.hf.custom_generate("ar"), **kw
    )
    assert torch.equal(got, want)
    assert got.shape[1] <= PROMPT.shape[1] + 10 and (got[0, PROMPT.shape[1] + 3 :] == 3).all()


def test_stopping_criteria_end_rows(tiny):
    class AfterFive(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT.shape[1] + 5, dtype=torch.bool)

    crit = transformers.StoppingCriteriaList([AfterFive()])
    ref = tiny.generate(PROMPT, max_new_tokens=16, do_sample=False, stopping_criteria=crit)
    out = tiny.generate(
        PROMPT,
        max_new_tokens=16,
        do_sample=False,
        stopping_criteria=crit,
        custom_generate=dspec.hf.custom_generate("dflash"),
    )
    assert torch.equal(out, ref) and out.shape[1] == PROMPT.shape[1] + 5


def test_return_dict_gives_the_output_class(tiny):
    out = tiny.generate(
        PROMPT,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        custom_generate=dspec.hf.custom_generate("ar"),
    )
    assert isinstance(out, transformers.generation.utils.GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, tiny.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_streamer_receives_the_prompt_then_the_new_tokens(tiny):
    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    s = Collect()
    out = tiny.generate(
        PROMPT, max_new_tokens=8, do_sample=False, streamer=s, custom_generate=dspec.hf.custom_generate("dflash")
    )
    assert s.ended and s.puts[0] == PROMPT[0].tolist()  # generate puts the prompt itself
    assert sum(s.puts[1:], []) == out[0, PROMPT.shape[1] :].tolist()


def test_sampling_follows_torch_manual_seed(tiny):
    kw = dict(
        max_new_tokens=8,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        top_p=1.0,
        custom_generate=dspec.hf.custom_generate("dflash"),
    )
    torch.manual_seed(3)
    a = tiny.generate(PROMPT, **kw)
    torch.manual_seed(3)
    b = tiny.generate(PROMPT, **kw)
    assert torch.equal(a, b) and a.shape[1] > PROMPT.shape[1]


def test_weights_shared_and_model_kept(tiny):
    m = dspec.hf.dspec_model(tiny)
    assert m is dspec.hf.dspec_model(tiny)
    assert m.embed_tokens.weight.data_ptr() == tiny.model.embed_tokens.weight.data_ptr()
    assert m.layers[0].mlp.up_proj.weight.data_ptr() == tiny.model.layers[0].mlp.up_proj.weight.data_ptr()
    assert tiny.model.embed_tokens.weight.requires_grad  # the HF model's parameters untouched
    assert m.shipped_name == "tiny-ar"


def test_cache_is_weak():
    model = _hf("tiny-ar")
    dspec.hf.dspec_model(model)
    ref = weakref.ref(model)
    del model
    import gc

    gc.collect()
    assert ref() is None


def test_bad_method_and_options():
    with pytest.raises(ValueError, match="method"):
        dspec.hf.custom_generate("nope")
    with pytest.raises(ValueError, match="does not take"):
        dspec.hf.custom_generate("dflash", no_such_option=1)
    with pytest.raises(ValueError, match="drafter"):
        dspec.hf.custom_generate("ar", drafter="tiny-ar-dflash")
    with pytest.raises(ValueError, match="max_new_tokens"):
        dspec.hf.custom_generate("ar", max_new_tokens=3)
    with pytest.raises(ValueError, match="preset"):
        dspec.hf.custom_generate("dflash", preset="fast")


def test_paper_preset_through_custom_generate(tiny):
    ref = tiny.generate(PROMPT, max_new_tokens=12, do_sample=False)
    fn = dspec.hf.custom_generate("dflash", preset="paper")
    assert torch.equal(tiny.generate(PROMPT, max_new_tokens=12, do_sample=False, custom_generate=fn), ref)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(do_sample=True, top_k=5), "top_k"),
        (dict(do_sample=True, top_k=0, top_p=0.9), "top_p"),
        (dict(do_sample=False, repetition_penalty=1.3), "logits_processor"),
        (dict(do_sample=False, num_beams=2), "num_beams"),
    ],
)
def test_unsupported_generation_settings(tiny, kw, name):
    with pytest.raises(ValueError, match=name):
        tiny.generate(PROMPT, max_new_tokens=4, custom_generate=dspec.hf.custom_generate("ar"), **kw)


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_greedy_equals_generate_smollm2(smollm2, method):
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345]])
    ref = smollm2.generate(prompt, max_new_tokens=16, do_sample=False)
    out = smollm2.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=dspec.hf.custom_generate(method))
    assert torch.equal(out, ref)
    batch = torch.tensor([[2, 2, 2, 1, 504, 3458, 282, 4649], [1, 504, 3458, 282, 4649, 314, 253, 1345]])
    mask = (torch.arange(8) >= torch.tensor([[3], [0]])).long()
    ref = smollm2.generate(input_ids=batch, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = smollm2.generate(
        input_ids=batch,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        custom_generate=dspec.hf.custom_generate(method),
    )
    assert torch.equal(out, ref)

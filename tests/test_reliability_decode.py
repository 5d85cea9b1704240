"""The decode methods under adversarial use: size options past what the model and the machine
hold (a ValueError naming the option and the bound, before any allocation), one model decoding
from several threads (the right tokens, no KeyError), a model whose logits are NaN (one clear
error from every method, greedy and sampled) and stats that are strict JSON."""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import dspec
from dspec.decode import bounds
from dspec.models import stack

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dspec" / "assets"
DRAFTERS = ASSETS / "drafters"
METHODS = ("ar", "diffusion", "ssd", "spiffy", "s2d2", "diffuspec", "dflash", "d2sd")
AR_METHODS = ("ar", "diffuspec", "dflash", "d2sd")


def _model_for(method, ar, bd):
    return ar if method in AR_METHODS else bd


# --------------------------------------------------------------------------- size bounds


def test_reproductions_of_unbounded_options_fail_fast_in_a_subprocess():
    """The exhausting values (quadratic chain, bad_alloc, a 1 TB mask, blocks past the
    context) each give a ValueError naming the option within seconds, under a 6 GiB address
    space cap -- in a subprocess, so a regression cannot take the machine."""
    script = textwrap.dedent("""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import dspec
        ar, bd = dspec.load("tiny-ar"), dspec.load("tiny-bd")
        cases = [("ssd", bd, {"draft_len": 10 ** 6}, "draft_len"),
                 ("dflash", ar, {"draft_len": 10 ** 6}, "draft_len"),
                 ("diffusion", bd, {"block_size": 10 ** 6}, "block_size"),
                 ("diffusion", bd, {"block_size": 4096}, "block_size"),
                 ("ssd", bd, {"block_size": 5000}, "block_size"),
                 ("spiffy", bd, {"block_size": 5000}, "block_size")]
        out = []
        for method, model, opts, name in cases:
            try:
                dspec.generate(model, "x = 1", method=method, max_new_tokens=8, **opts)
                out.append([method, name, "decoded"])
            except Exception as e:
                out.append([method, name, type(e).__name__ + ": " + str(e)])
        print(json.dumps(out))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    for method, name, outcome in results:
        assert outcome.startswith("ValueError: ") and name in outcome, (method, name, outcome)
        assert "context" in outcome or "MAX_DRAFT_LEN" in outcome, (method, name, outcome)
    assert time.perf_counter() - start < 200


# (method, options, the option the error names); every size option of every method
PAST_BOUNDS = [
    ("diffusion", {"block_size": 2049}, "block_size"),  # 2 * 2049 rows + the prompt > 4096
    ("diffusion", {"block_size": 10**12}, "block_size"),
    ("ssd", {"block_size": 1366}, "block_size"),  # 3 copies of 1366 rows
    ("ssd", {"draft_len": bounds.MAX_DRAFT_LEN + 1}, "draft_len"),
    ("ssd", {"block_size": 16, "draft_len": 200, "mixed_order": True}, "draft_len"),  # 401 copies of 16 rows
    ("spiffy", {"block_size": 1366}, "block_size"),
    ("spiffy", {"graph_size": bounds.MAX_GRAPH_NODES + 1}, "graph_size"),
    ("spiffy", {"graph_size": 10**9}, "graph_size"),
    ("s2d2", {"block_size": 1366}, "block_size"),
    ("s2d2", {"block_size": 64}, "block_size"),  # redraft blocks: ~ (64 + 4) * 64 rows
    ("s2d2", {"block_size": 10**7, "draft_len": 1}, "block_size"),
    ("dflash", {"draft_len": bounds.MAX_DRAFT_LEN + 1}, "draft_len"),
    ("dflash", {"tree": bounds.MAX_TREE_NODES + 1}, "tree"),
    ("dflash", {"tree": 10**6}, "tree"),
    ("dflash", {"tree": 7, "lookup": 10**6}, "lookup"),
    ("d2sd", {"draft_len": 10**6}, "draft_len"),
    ("d2sd", {"tree": 10**6}, "tree"),
    ("d2sd", {"lookup": 10**9}, "lookup"),
    ("d2sd", {"draft_len": 250, "k": 200, "redraft_min": 0}, "k"),  # 200 branches of 250 nodes
    ("d2sd", {"draft_len": 250, "k": 2, "boundary_pool": 200, "redraft_min": 0}, "boundary_pool"),
    ("diffuspec", {"draft_len": 10**6}, "draft_len"),
    ("diffuspec", {"k_max": 10**6}, "k_max"),
    ("diffuspec", {"k_min": 10**6, "k_max": 10**6}, "k_m"),
    ("diffuspec", {"beam": 10**6}, "beam"),
    ("diffuspec", {"lookup": 10**6}, "lookup"),
]


@pytest.mark.parametrize(
    "method, options, name",
    PAST_BOUNDS,
    ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for m, o, _ in PAST_BOUNDS],
)
def test_size_options_past_their_bound_raise_before_any_work(ar, bd, method, options, name):
    model = _model_for(method, ar, bd)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=name) as err:
        dspec.generate(model, "def add(a, b):", method=method, max_new_tokens=4, **options)
    assert "at most" in str(err.value) or "context" in str(err.value)
    assert time.perf_counter() - start < 5  # raised before the work, not after it


def test_context_bound_is_the_documented_formula(tmp_path):
    """At a context of 256 (the test checkpoints'), a block-causal diffusion step forwards two
    blocks: prompt + 2 * block_size = 256 decodes, one more row is refused with the bound
    spelled out."""
    from tiny_checkpoints import write_checkpoint

    model = dspec.load(write_checkpoint(tmp_path / "sdar", "sdar", seed=1), dtype="float32")
    assert model.config.max_position_embeddings == 256
    prompt = list(range(10, 16))  # 6 tokens: 6 + 2 * 125 = 256
    out = dspec.generate(model, prompt, method="diffusion", max_new_tokens=3, block_size=125, tokens_per_step=125)
    assert len(out.tokens) == 3
    with pytest.raises(ValueError, match=r"block_size = 126 .* 2 \* block_size .* <= 256"):
        dspec.generate(model, prompt, method="diffusion", max_new_tokens=3, block_size=126)


def test_bounds_are_documented_in_the_methods():
    from dspec.decode import d2sd, dflash, diffusion, diffuspec, s2d2, spiffy, ssd

    for fn in (
        diffusion.decode_diffusion,
        ssd.decode,
        spiffy.decode,
        s2d2.decode_s2d2,
        dflash.decode_dflash,
        d2sd.decode_d2sd,
        diffuspec.decode_diffuspec,
    ):
        assert "decode.bounds" in fn.__doc__ and "max_position_embeddings" in fn.__doc__, fn.__qualname__


# --------------------------------------------------------------------------- threads


def test_frozen_weights_scopes_closing_out_of_order():
    """Two scopes on one model that close in the order they opened (what two threads do):
    no KeyError, the state gone after the last."""
    model = dspec.load("tiny-ar")
    a, b = stack.frozen_weights(model), stack.frozen_weights(model)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert model.__dict__["_stack_frozen"][0] == 1
    b.__exit__(None, None, None)
    assert "_stack_frozen" not in model.__dict__


def _run_threads(jobs):
    results, errors = {}, []

    def run(key, fn):
        try:
            results[key] = fn()
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append((key, repr(e)))

    threads = [threading.Thread(target=run, args=(key, fn)) for key, fn in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    return results


@pytest.mark.parametrize("method", ["ar", "dflash", "spiffy", "diffuspec"])
def test_two_threads_on_one_model_give_their_single_thread_tokens(ar, bd, method):
    """The reproduction: thread b starts while a decodes (and ends after it); both finish, each
    with the tokens of its own single-thread run (greedy)."""
    model = _model_for(method, ar, bd)
    kw = dict(method=method)
    want_a = dspec.generate(model, "def add(a, b):", max_new_tokens=16, **kw).tokens
    want_b = dspec.generate(model, "class Foo:", max_new_tokens=48, **kw).tokens
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as often as possible
    try:
        for _ in range(2):
            got = _run_threads(
                {
                    "a": lambda: dspec.generate(model, "def add(a, b):", max_new_tokens=16, **kw).tokens,
                    "b": lambda: (
                        (time.sleep(0.02), dspec.generate(model, "class Foo:", max_new_tokens=48, **kw))[1].tokens
                    ),
                }
            )
            assert got == {"a": want_a, "b": want_b}
    finally:
        sys.setswitchinterval(switch)
    assert "_stack_frozen" not in model.__dict__


def test_threads_on_one_mask_adapted_model(tmp_path):
    """A mask-adapted model keeps per-forward state (the [MASK] rows): it is per thread, so
    threads decoding one adapted model each get their own tokens, sampled with a seed too."""
    from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

    base = dspec.load(write_checkpoint(tmp_path / "llama", "llama", seed=3), dtype="float32")
    model = trained_looking_mask_adapter(base, mask_token_id=5)
    prompts = {"a": [7, 8, 9, 10, 11], "b": [12, 13], "c": [20, 21, 22]}
    kw = dict(method="diffusion", max_new_tokens=12)
    want = {k: dspec.generate(model, p, **kw).tokens for k, p in prompts.items()}
    want_t = {k: dspec.generate(model, p, temperature=1.0, seed=5, **kw).tokens for k, p in prompts.items()}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        got = _run_threads({k: (lambda p=p: dspec.generate(model, p, **kw).tokens) for k, p in prompts.items()})
        got_t = _run_threads(
            {
                k: (lambda p=p: dspec.generate(model, p, temperature=1.0, seed=5, **kw).tokens)
                for k, p in prompts.items()
            }
        )
    finally:
        sys.setswitchinterval(switch)
    assert got == want and got_t == want_t
    assert model.mask_adapter.rows.index is None


def test_mask_rows_survive_copies(tmp_path):
    import copy
    import pickle

    from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

    base = dspec.load(write_checkpoint(tmp_path / "llama", "llama", seed=3), dtype="float32")
    model = trained_looking_mask_adapter(base, mask_token_id=5)
    twin = copy.deepcopy(model)
    # one shared MaskRows per model, as before the copy
    rows = {id(m.rows) for m in twin.modules() if hasattr(m, "rows") and hasattr(m.rows, "index")}
    assert len(rows) == 1 and twin.mask_adapter.rows is not model.mask_adapter.rows
    assert pickle.loads(pickle.dumps(model.mask_adapter.rows)).index is None
    assert (
        dspec.generate(twin, [7, 8, 9], method="diffusion", max_new_tokens=6).tokens
        == dspec.generate(model, [7, 8, 9], method="diffusion", max_new_tokens=6).tokens
    )


def test_weight_table_keeps_its_tensors_alive(tmp_path):
    """A layer-stack table holds references to the packed weights and adapter operands whose
    addresses it passes to C++: a thread that re-packs one meanwhile cannot free what a
    forward reads."""
    from tiny_checkpoints import trained_looking_mask_adapter, write_checkpoint

    base = dspec.load(write_checkpoint(tmp_path / "llama", "llama", seed=3), dtype="float32")
    for model in (base, trained_looking_mask_adapter(base, mask_token_id=5)):
        table = stack.weight_table(model)
        if table is None:
            pytest.skip("no C++ layer stack here")
        ptrs = {p for p in [*table.weights, *table.lora, *table.lora_packed] if p}
        assert ptrs <= {t.data_ptr() for t in table.keep} | {p.data_ptr() for p in table.params}
        assert len(table.keep) >= 7 * model.config.num_layers


# --------------------------------------------------------------------------- NaN logits


def _nan_copy(src: Path, dst: Path, tensor: str = "model.norm.weight") -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    assert tensor in weights, sorted(weights)[-5:]
    weights[tensor] = torch.full_like(weights[tensor], float("nan"))
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def nan_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    return (
        dspec.load(_nan_copy(ASSETS / "tiny-ar", root / "ar")),
        dspec.load(_nan_copy(ASSETS / "tiny-bd", root / "bd")),
    )


def _drafter_for(method):
    if method == "dflash":
        return str(DRAFTERS / "tiny-ar-dflash")
    if method == "d2sd":
        return (str(DRAFTERS / "tiny-ar-dflash"), str(DRAFTERS / "tiny-ar-vp"))
    if method == "diffuspec":
        return "tiny-bd"
    return None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", METHODS)
def test_nan_logits_stop_every_method_with_one_clear_error(nan_models, method, temperature, monkeypatch, tmp_path):
    """The reproduction (a checkpoint whose final norm is NaN): every method, greedy and
    sampled, stops with the one ValueError of require_finite -- never an IndexError or a
    RuntimeError from a -1 fed back as a token."""
    monkeypatch.setenv("DSPEC_CACHE_DIR", str(tmp_path))  # spiffy would calibrate a graph
    nar, nbd = nan_models
    model = nar if method in AR_METHODS else nbd
    kw = dict(method=method, max_new_tokens=6, temperature=temperature, seed=0)
    drafter = _drafter_for(method)
    if drafter is not None:
        kw["drafter"] = drafter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the drafters' target fingerprint
        with pytest.raises(
            ValueError,
            match=r"the target model's logits hold NaN or inf|"
            r"the model's logits hold NaN or inf",
        ):
            dspec.generate(model, "def f(x):", **kw)


@pytest.mark.parametrize("method", ["dflash", "d2sd", "diffuspec"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_drafter_is_named(ar, nan_models, method, temperature):
    """A drafter whose logits are NaN (the target finite) stops the call with the error naming
    the drafter."""
    from dspec.models.dflash import load_drafter

    if method == "diffuspec":
        drafter = nan_models[1]
        opts = {}
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = load_drafter(DRAFTERS / "tiny-ar-dflash", ar, kind="dflash")
        with torch.no_grad():
            first.norm.weight.fill_(float("nan"))
        drafter = first if method == "dflash" else (first, str(DRAFTERS / "tiny-ar-vp"))
        opts = {"redraft_min": 0} if method == "d2sd" else {}
    for extra in ({}, {"cps": False}) if method == "diffuspec" else ({}, {"tree": None}):
        with pytest.raises(ValueError, match="drafter's logits hold NaN or inf"):
            dspec.generate(
                ar,
                "def f(x):",
                method=method,
                max_new_tokens=6,
                drafter=drafter,
                temperature=temperature,
                seed=0,
                **opts,
                **extra,
            )


def test_require_finite_marks():
    from dspec.decode.sampling import next_tokens, require_finite

    assert require_finite(torch.tensor([0, 3])).tolist() == [0, 3]
    require_finite(torch.zeros(0, dtype=torch.int64))
    for row in ([float("nan"), 0.0], [float("inf"), 0.0], [float("-inf"), float("-inf")]):
        with pytest.raises(ValueError, match="NaN or inf"):
            next_tokens(torch.tensor([[0.0, 1.0], row]), 0.0, None)
        with pytest.raises(ValueError, match="drafter's logits"):
            next_tokens(torch.tensor([row]), 1.0, torch.Generator().manual_seed(0), who="drafter")


# --------------------------------------------------------------------------- JSON-safe stats


def _finite(x):
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return True


@pytest.mark.parametrize("method", METHODS)
def test_stats_are_strict_json(ar, bd, method):
    """No inf / NaN in any method's stats (d2sd's CPU gate reports redraft_min None: never)."""
    model = _model_for(method, ar, bd)
    for temperature in (0.0, 1.0):
        out = dspec.generate(model, "x = 1", method=method, max_new_tokens=8, temperature=temperature, seed=1)
        json.dumps(out.stats, allow_nan=False)
        assert _finite(out.stats), out.stats
    if method == "d2sd":
        assert out.stats["redraft_min"] is None
        gated = dspec.generate(model, "x = 1", method=method, max_new_tokens=8, redraft_min=0.5)
        assert gated.stats["redraft_min"] == 0.5


def test_cli_json_of_d2sd_is_strict_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspec",
            "generate",
            "--model",
            "tiny-ar",
            "--method",
            "d2sd",
            "--max-new-tokens",
            "8",
            "--prompt",
            "x",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Infinity" not in proc.stdout and "NaN" not in proc.stdout

    def reject(name):
        raise ValueError(name)

    json.loads(proc.stdout, parse_constant=reject)

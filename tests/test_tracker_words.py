"""Docs, comments, model cards and result file names speak of the project, not of its work
log: no "session N", "issue N" or "s37"-style tags where users read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# where users read: the README, docs, the changelog, the package (code, comments, model
# cards), the C++ sources, the bench scripts and notes
TEXT_GLOBS = (
    "README.md",
    "CHANGELOG.md",
    "docs/**/*.md",
    "dspec/**/*.py",
    "dspec/assets/**/*.md",
    "csrc/**/*.cpp",
    "csrc/**/*.h",
    "csrc/**/*.cu",
    "csrc/**/*.cuh",
    "bench/*.py",
    "bench/*.sh",
    "bench/*.cpp",
    "bench/**/*.md",
)

TRACKER = re.compile(
    r"\b(?:session|issue)s?[\s-]*#?\d+"  # session 37, issue 14, session-17, sessions 14-22
    r"|\bsessions?\b"  # this session, earlier sessions
    r"|\bs\d{2}\b",  # s37-style tags
    re.IGNORECASE,
)

# phrases where the word is not a tracker reference
ALLOWED = re.compile(r"HTTP sessions?|scope=[\"']session[\"']", re.IGNORECASE)

# a result file named after a log entry: e2e_smollm2_s37.json, h100-2026-11-27-s26/
RESULT_NAME = re.compile(r"[_-]s\d+(?=[._-]|$)|session", re.IGNORECASE)


def _text_files():
    seen = set()
    for pattern in TEXT_GLOBS:
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and path not in seen and "_C" not in path.name:
                seen.add(path)
                yield path


def _hits(text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        clean = ALLOWED.sub("", line)
        for m in TRACKER.finditer(clean):
            hits.append(f"{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return hits


def test_no_tracker_words_in_docs_code_or_model_cards():
    found = {}
    for path in _text_files():
        hits = _hits(path.read_text(encoding="utf-8", errors="replace"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, "tracker words where users read:\n" + "\n".join(f"{f}:{h}" for f, hs in found.items() for h in hs)


def test_no_tracker_tags_in_result_file_names():
    bad = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "bench" / "results").rglob("*")
        if RESULT_NAME.search(p.stem if p.is_file() else p.name)
    ]
    assert not bad, f"result files named after a log entry: {bad}"


def test_the_checks_catch_what_they_are_for():
    for text in (
        "measured in session 37",
        "sessions 14-22",
        "see issue 14",
        "round 2 of session 5",
        "this session's kernels",
        "the s37 grid",
        "Session-17 numbers",
    ):
        assert _hits(text), text
    for text in (
        "an HTTP session",
        '@pytest.fixture(scope="session")',
        "round 8 of the adapter",
        "the s2d2 method",
        "q_s0, q_s1",
        "issue the calls back to back",
    ):
        assert not _hits(text), text
    for name in ("e2e_smollm2_s37", "ab_ssd_bs8_s19", "h100-2026-11-27-s26", "session_grid"):
        assert RESULT_NAME.search(name), name
    for name in (
        "e2e_s2d2_native_batch2_2026-11-28",
        "widths_s2d2_2026-11-29",
        "ab_adapters_r4_vs_r5",
        "e2e_tree_t1_2026-11-27_seed1",
    ):
        assert not RESULT_NAME.search(name), name

"""``ssd`` is Self Speculative Decoding for dLLMs (arXiv 2510.04147): the CLI's help and the
docs that list the methods say so, and tell it apart from "Speculative Speculative Decoding"
(arXiv 2603.03251), a different method that is also called SSD."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _flat(text: str) -> str:
    return " ".join(text.split())  # help and Markdown wrap lines anywhere


def test_generate_help_names_ssd():
    out = subprocess.run(
        [sys.executable, "-m", "dspec", "generate", "--help"], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    flat = _flat(out)
    assert "Self Speculative Decoding for dLLMs (arXiv 2510.04147)" in flat
    assert "not Speculative Speculative Decoding (arXiv 2603.03251)" in flat


@pytest.mark.parametrize("rel", ["README.md", "docs/methods.md", "dspec/decode/ssd.py"])
def test_docs_name_ssd(rel):
    flat = _flat((ROOT / rel).read_text(encoding="utf-8"))
    assert "Self Speculative Decoding" in flat and "2510.04147" in flat
    assert '"Speculative Speculative Decoding" (arXiv 2603.03251), a different method' in flat

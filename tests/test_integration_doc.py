"""docs/integration.md: every ```python block runs, in order, in one namespace (CPU)."""

import pathlib
import re
import sys
import types

import pytest
import torch

import dspec

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "integration.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_the_engine_calls():
    text = "\n".join(_blocks())
    for call in (
        "verify_chain",
        "verify_tree",
        "tree_mask",
        "cascade_attention",
        "merge_states",
        "prefix_page_table",
        "prefix_indptr",
        "count_host_syncs",
        "torch.compile",
    ):
        assert call in text, call


@pytest.fixture
def restore_config():
    saved = dspec.config.validate_values
    yield
    dspec.config.validate_values = saved
    torch._dynamo.reset()


def test_doc_snippets_run(restore_config, capsys, monkeypatch):
    # a registered module, not a bare dict: torch.compile (2.11) imports a traced function's
    # module by name to read its globals
    module = types.ModuleType("integration_doc")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for i, block in enumerate(_blocks()):
        try:
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message names the block
            raise AssertionError(f"block {i} of {DOC.name} failed:\n{block}") from exc
    assert "syncs" in namespace

"""Reading the training commands' own files (``data.pt``, ``checkpoint.pt``) without running
code from them.

The files are written with ``torch.save`` and hold only tensors and plain data (dicts,
lists, tuples, ints, floats, strings, None; an optimizer's state dict is such data).  They
are read with torch's weights-only unpickler (``torch.load(weights_only=True)``), which
builds exactly those types and refuses every other global before anything is constructed
-- a pickle that would call a function (``os.system``, ``open``, ...) on loading is a
ValueError, never run.  The files the earlier releases wrote read as before.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch


def load_state(path, what: str, *, keys=(), map_location="cpu") -> dict:
    """The dict stored in ``path`` by ``torch.save``, read weights-only.

    what : how the file is named in errors (e.g. ``"--data"``, ``"resume: checkpoint.pt"``).
    keys : the entries the dict must have.

    Raises FileNotFoundError when ``path`` is no file, ValueError when it is not a torch.save
    file of tensors and plain data (a pickle of other objects is refused unread: nothing in it
    runs), or not a dict with ``keys``.
    """
    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} is not a file")
    try:
        with warnings.catch_warnings():  # a bare pickle's protocol note is noise here
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - every unpickling failure is a bad file
        raise ValueError(
            f"{what}: {path} is not a dspec training file of tensors and plain data "
            f"({_reason(e)}); it was not loaded and nothing in it ran"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{what}: {path} holds a {type(state).__name__}, not the dict dspec's training commands write")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{what}: {path} lacks the entries {missing} (it is not a file of this command)")
    return state


def _reason(exc: Exception) -> str:
    """The gist of torch's (long, multi-paragraph) weights-only refusal."""
    text = str(exc)
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if m:
        return f"it asks to build {m.group(1)}"
    m = re.search(r"Unsupported operand (\d+)", text)
    if m:
        return f"it uses a pickle instruction (operand {m.group(1)}) the weights-only reader refuses"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__

"""Reading a checkpoint directory's files defensively: only regular files (a FIFO, socket or
device named like a checkpoint file would block or never end), JSON of bounded size that
must parse as UTF-8 text, and paths that stay inside the directory.  Every problem is a
ValueError naming the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

# config.json, generation_config.json, tokenizer_config.json and the shard index are a few
# kB to a few MB in real checkpoints
MAX_JSON_BYTES = 64 << 20


def is_regular_file(file: Path) -> bool:
    """Whether ``file`` exists (symlinks followed, as in the Hugging Face cache's snapshot
    directories); ValueError when it exists but is not a regular file."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ValueError(f"{file}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{file}: not a regular file (a directory, FIFO, socket or device); checkpoint files must be regular files"
        )
    return True


def read_json(file: Path, *, required: bool, missing: str | None = None, want=None):
    """The parsed JSON of ``file``; None when absent and not ``required`` (ValueError with
    ``missing`` or a default message when required).  ``want``: the JSON type the file must
    hold at its top level (e.g. ``dict``)."""
    file = Path(file)
    if not is_regular_file(file):
        if required:
            raise ValueError(missing or f"{file.parent}: no {file.name}")
        return None
    size = os.stat(file).st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{file}: {size} bytes, larger than a {file.name} can be ({MAX_JSON_BYTES} bytes)")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{file}: not valid JSON (nested too deeply)") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot be read ({e.strerror or e})") from None
    if want is not None and not isinstance(data, want):
        raise ValueError(
            f"{file}: must hold a JSON {'object' if want is dict else want.__name__}, got {type(data).__name__}"
        )
    return data


def inside(root: Path, relative) -> Path:
    """``root / relative`` for a relative path that stays inside ``root`` when read lexically
    (no absolute path, no ``..`` climbing out); ValueError otherwise.  Symlinks inside
    ``root`` are followed later, as for the directory's own files."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise ValueError(f"{root}: a file name must be a non-empty string, got {relative!r:.80}")
    norm = os.path.normpath(relative)
    if os.path.isabs(relative) or norm == ".." or norm.startswith(".." + os.sep) or norm == ".":
        raise ValueError(f"{root}: {relative!r:.200} points outside the checkpoint directory")
    return root / norm

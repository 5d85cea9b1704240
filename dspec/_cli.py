"""What every dspec command line shares.

* :func:`run_command`: the one place where a command's user errors become a one-line
  ``error: ...`` on stderr with exit status 2 (no traceback), a failed allocation one line
  with status 1, and Ctrl-C a quiet exit with status 130.  ``python -m dspec`` (generate, bench),
  ``python -m dspec.bench_e2e`` and the training commands (``python -m dspec.train ...``) all run through it.
* :func:`dumps` / :func:`finite`: strict JSON (RFC 8259): non-finite floats (NaN, +-inf,
  which ``json.dumps`` writes as the non-JSON literals ``NaN`` / ``Infinity``) become
  ``null``, and ``allow_nan=False`` guarantees that nothing else slips through.
* :func:`parse_value` (``--option`` values) and :func:`add_threads_argument` (``--threads``):
  flags that ``python -m dspec generate`` and ``bench`` share.
"""

from __future__ import annotations

import json
import math
import os
import sys

# exceptions that report what the user asked for (a flag's value, a path), not a bug of
# dspec: ValueError is the library's documented error for bad input, FileNotFoundError
# dspec.load's for a missing model; the others come from the paths given (an --out that is a
# file, a cache directory that is not writable, ...)
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
# set to show the traceback of a user error too (debugging)
TRACEBACK_ENV = "DSPEC_TRACEBACK"


def error_line(exc: BaseException) -> str:
    """``exc`` as one line: an OSError from a path as ``PATH: what``, else its message."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        msg = f"{exc.filename}: {exc.strerror}"
        if exc.filename2 is not None:
            msg += f" (and {exc.filename2})"
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            msg += " (a path that must be a directory is a file, or one of its parents is)"
    else:
        msg = str(exc) or type(exc).__name__
    return " ".join(msg.split())


def run_command(func, *args, **kwargs) -> int:
    """Call ``func(*args, **kwargs)`` as a command: its int result is the exit status (any
    other result: 0); a user error (:data:`USER_ERRORS`, or ``SystemExit`` with a message)
    prints ``error: MESSAGE`` as one line on stderr and returns 2, like argparse's errors;
    an allocation that failed (:func:`out_of_memory`) prints ``error: out of memory: ...`` and
    returns 1; KeyboardInterrupt returns 130 (128 + SIGINT) without a word.
    ``$DSPEC_TRACEBACK`` set re-raises user errors instead.  Any other exception is a bug and
    keeps its traceback."""
    try:
        code = func(*args, **kwargs)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        _print_error(error_line(e))
        return 2
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e) or os.environ.get(TRACEBACK_ENV):
            raise
        _print_error(f"out of memory: {error_line(e)} (a smaller size, batch or length fits)")
        return 1
    except SystemExit as e:
        if not isinstance(e.code, str):  # argparse's exits and sys.exit(n) keep their status
            raise
        _print_error(" ".join(e.code.split()))
        return 2
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed: MemoryError, torch's OutOfMemoryError (CUDA)
    or the CPU allocator's RuntimeError ("can't allocate memory")."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _print_error(msg: str) -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"error: {msg}", file=sys.stderr, flush=True)


def finite(obj):
    """``obj`` with every non-finite float (in dicts, lists and tuples, recursively) replaced
    by None; tuples become lists (as JSON writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, *, default=None, **kwargs) -> str:
    """``json.dumps`` that always writes strict JSON: non-finite floats as null (also in what
    ``default`` returns), ``allow_nan=False``."""
    wrapped = None if default is None else (lambda o: finite(default(o)))
    return json.dumps(finite(obj), allow_nan=False, default=wrapped, **kwargs)


def json_safe(obj):
    """``obj`` as the plain JSON data it is written as: strict (non-finite floats None),
    anything JSON has no type for as its ``str``."""
    return json.loads(dumps(obj, default=str))


def parse_value(text: str):
    """``--option`` values: true/false -> bool, none -> None, then int, float, else str."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def add_threads_argument(p) -> None:
    """``--threads`` of every CLI command (applied by ``python -m dspec`` before the command)."""
    p.add_argument(
        "--threads",
        default=None,
        metavar="N|auto",
        help="CPU threads for torch and dspec's C++ kernels (default: "
        "$DSPEC_NUM_THREADS, else auto = the cores idle now; on a machine "
        "shared with another busy job use fewer threads than cores)",
    )

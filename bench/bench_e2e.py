"""End-to-end benchmark grid (methods x prompt sets): a thin wrapper of ``dspec.bench_e2e``,
which ``python -m dspec bench`` runs too (the logic lives in the package so that it works
from an installed dspec).

    python bench/bench_e2e.py --dllm tiny-bd --target tiny-ar [--quick] [--out DIR] ...
    python bench/bench_e2e.py --help

See ``dspec/bench_e2e.py`` for what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from dspec.bench_e2e import main

if __name__ == "__main__":
    sys.exit(main(prog="bench/bench_e2e.py"))

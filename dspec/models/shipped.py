"""The checkpoints dspec ships or installs: name -> a function returning a local checkpoint
directory (converted / cached on first use).  Below ``dspec.hub`` (which loads them) and
``dspec.train`` (which starts recipes from them), so neither imports the other for it."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def _smollm2() -> Path:
    from .embedded import smollm2_checkpoint

    return smollm2_checkpoint()


def _asset(name: str):
    def locate() -> Path:
        path = ASSETS / name
        if not (path / "config.json").is_file():
            raise ValueError(
                f"shipped model {name!r} is missing from this installation ({path}); "
                f"reinstall dspec with its package data (dspec/assets)"
            )
        return path

    locate.__name__ = f"_asset_{name.replace('-', '_')}"
    return locate


# name -> a function returning a local checkpoint directory (converted / cached on first use)
SHIPPED = {"smollm2-135m": _smollm2, "tiny-ar": _asset("tiny-ar"), "tiny-bd": _asset("tiny-bd")}

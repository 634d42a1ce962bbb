"""The reader: `MemmapDataset` over a compiled dataset, and its fast batch `Loader`.

The names below are imported when first used (PEP 562), as `dsc`'s are: the storage layer uses the
gather stage (`dsc.reader.gather`, numpy only), and importing it must not import torch with the
dataset (`dsc info s3://...` is one of the light commands)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {"MemmapDataset": "dsc.reader.dataset", "GatheredBatch": "dsc.reader.dataset", "Sample": "dsc.reader.dataset",
         "Loader": "dsc.reader.loader", "ORDERS": "dsc.reader.order"}

if TYPE_CHECKING:
    from dsc.reader.dataset import GatheredBatch, MemmapDataset, Sample
    from dsc.reader.loader import Loader
    from dsc.reader.order import ORDERS

__all__ = ["MemmapDataset", "Loader", "Sample", "GatheredBatch", "ORDERS"]


def __getattr__(name: str) -> Any:
    """`dsc.reader.MemmapDataset`, and its submodules (`dsc.reader.sampling`): imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"dsc.reader.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dsc.reader.{name}":
                raise
            raise AttributeError(f"module 'dsc.reader' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'dsc.reader' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

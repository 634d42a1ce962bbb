"""The reader: `MemmapDataset` over a compiled dataset, and its fast batch `Loader`.

The names below are imported when first used (PEP 562), as `dsc`'s are: the storage layer uses the
gather stage (`dsc.reader.gather`, numpy only), and importing it must not import torch with the
dataset (`dsc info s3://...` is one of the light commands)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsc.lazy import lazy_names

_LAZY = {"MemmapDataset": "dsc.reader.dataset", "GatheredBatch": "dsc.reader.dataset", "Sample": "dsc.reader.dataset",
         "Loader": "dsc.reader.loader", "ORDERS": "dsc.reader.order"}

if TYPE_CHECKING:
    from dsc.reader.dataset import GatheredBatch, MemmapDataset, Sample
    from dsc.reader.loader import Loader
    from dsc.reader.order import ORDERS

__all__ = ["MemmapDataset", "Loader", "Sample", "GatheredBatch", "ORDERS"]


__getattr__ = lazy_names(__name__, _LAZY, globals())  # and its submodules (`dsc.reader.sampling`)


def __dir__() -> list[str]:
    return sorted(__all__)

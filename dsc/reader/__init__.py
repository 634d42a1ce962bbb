"""The reader: `MemmapDataset` over a compiled dataset, and its fast batch `Loader`."""

from dsc.reader.dataset import GatheredBatch, MemmapDataset, Sample
from dsc.reader.loader import Loader
from dsc.reader.order import ORDERS

__all__ = ["MemmapDataset", "Loader", "Sample", "GatheredBatch", "ORDERS"]

"""dsc: compile an image folder once into fixed-shape uint8 shards; read them into the GPU fast.

The names below are imported when first used (PEP 562), not with the package: `import dsc`
alone does not import torch, so the `dsc` command can start quietly (see `dsc.__main__`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsc.errors import (
    ChecksumError,
    CompileError,
    DatasetError,
    DscError,
    ImageError,
    LoaderError,
    UnsupportedVersionError,
)
from dsc.lazy import lazy_names
from dsc.version import __version__

_LAZY = {"compile_folder": "dsc.compiler.pipeline", "CompileSummary": "dsc.compiler.pipeline",
         "MemmapDataset": "dsc.reader.dataset", "class_balanced_weights": "dsc.reader.sampling"}

if TYPE_CHECKING:
    from dsc.compiler.pipeline import CompileSummary, compile_folder
    from dsc.reader.dataset import MemmapDataset
    from dsc.reader.sampling import class_balanced_weights

__all__ = ["compile_folder", "CompileSummary", "MemmapDataset", "class_balanced_weights", "DscError", "DatasetError",
           "CompileError", "ImageError", "LoaderError", "ChecksumError", "UnsupportedVersionError", "__version__"]


__getattr__ = lazy_names(__name__, _LAZY, globals())  # `dsc.MemmapDataset`, `dsc.transforms`...: on first use


def __dir__() -> list[str]:
    return sorted(__all__)

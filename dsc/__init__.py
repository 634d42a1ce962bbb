"""dsc: compile an image folder once into fixed-shape uint8 shards; read them into the GPU fast.

The names below are imported when first used (PEP 562), not with the package: `import dsc`
alone does not import torch, so the `dsc` command can start quietly (see `dsc.__main__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsc.errors import (
    ChecksumError,
    CompileError,
    DatasetError,
    DscError,
    ImageError,
    LoaderError,
    UnsupportedVersionError,
)
from dsc.version import __version__

_LAZY = {"compile_folder": "dsc.compiler.pipeline", "CompileSummary": "dsc.compiler.pipeline",
         "MemmapDataset": "dsc.reader.dataset", "class_balanced_weights": "dsc.reader.sampling"}

if TYPE_CHECKING:
    from dsc.compiler.pipeline import CompileSummary, compile_folder
    from dsc.reader.dataset import MemmapDataset
    from dsc.reader.sampling import class_balanced_weights

__all__ = ["compile_folder", "CompileSummary", "MemmapDataset", "class_balanced_weights", "DscError", "DatasetError",
           "CompileError", "ImageError", "LoaderError", "ChecksumError", "UnsupportedVersionError", "__version__"]


def __getattr__(name: str) -> Any:
    """`dsc.MemmapDataset`, `from dsc import compile_folder`, `dsc.transforms`...: imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"dsc.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dsc.{name}":
                raise
            raise AttributeError(f"module 'dsc' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'dsc' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

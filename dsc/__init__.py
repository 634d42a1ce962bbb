"""dsc: compile an image folder once into fixed-shape uint8 shards; read them into the GPU fast."""

__version__ = "0.1.0"

from dsc.compiler import CompileSummary, compile_folder  # noqa: E402
from dsc.errors import (  # noqa: E402
    ChecksumError,
    CompileError,
    DatasetError,
    DscError,
    ImageError,
    LoaderError,
    UnsupportedVersionError,
)
from dsc.reader import MemmapDataset  # noqa: E402

__all__ = ["compile_folder", "CompileSummary", "MemmapDataset", "DscError", "DatasetError", "CompileError",
           "ImageError", "LoaderError", "ChecksumError", "UnsupportedVersionError", "__version__"]

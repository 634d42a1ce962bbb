"""dsc: compile an image folder once into fixed-shape uint8 shards; read them into the GPU fast."""

__version__ = "0.1.0"

from dsc.compiler import CompileSummary, compile_folder  # noqa: E402
from dsc.errors import (  # noqa: E402
    ChecksumError,
    CompileError,
    DatasetError,
    DscError,
    ImageError,
    UnsupportedVersionError,
)

__all__ = ["compile_folder", "CompileSummary", "DscError", "DatasetError", "CompileError",
           "ImageError", "ChecksumError", "UnsupportedVersionError", "__version__"]

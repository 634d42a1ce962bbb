"""The version of dsc (a leaf: the compiler records it without importing the package's API)."""

__version__ = "0.1.0"

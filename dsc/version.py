"""The version of dsc (a leaf: the compiler records it without importing the package's API).

A partial build records the version that began it and only that version resumes it: bump it
whenever a build's plan gains a key (0.2.0: `alpha`), so an older dsc never resumes a newer plan.
"""

__version__ = "0.2.0"

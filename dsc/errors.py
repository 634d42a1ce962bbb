"""One exception family for everything dsc reports, so callers can catch `DscError`."""


class DscError(Exception):
    """Base of every error dsc raises on purpose."""


class DatasetError(DscError, ValueError):
    """A dataset folder is missing, damaged, or not what its manifest claims."""


class UnsupportedVersionError(DatasetError):
    """The dataset was written in a format version this dsc cannot read."""


class ChecksumError(DatasetError):
    """A file's bytes do not match the checksum recorded in the manifest."""


class StorageError(DatasetError):
    """Where the dataset is could not be read (an endpoint that does not answer, refused credentials),
    which says nothing about the dataset itself: it is never reported as a missing or damaged file."""


class CompileError(DscError):
    """A compile cannot start or cannot finish (bad options, bad SRC/OUT, --strict failure)."""


class ImageError(DscError):
    """One source image cannot be decoded; the compiler skips it or, with strict, fails."""


class LoaderError(DscError, RuntimeError):
    """A batch could not be produced; the message names the batch, the cause is chained."""


class NotReplaceableError(CompileError, DatasetError):
    """OUT (or a folder dsc would delete) holds something that is not a dsc dataset of its own: a
    user's files are never replaced or deleted, even with --force. A CompileError, as every refusal
    of a compile is, and a DatasetError: what was found is not (only) a dataset."""


def quoted(value: object, limit: int) -> str:
    """`value`'s repr for a message, at most `limit` characters: a longer one keeps its start and end around
    a '…', so a long path still shows its file name, and a cut value never looks whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C (or SIGTERM) that stopped a write, with what it left, said truly: the CLI prints the message."""

"""Storage: where a dataset's files are, between the format (`dsc.format`) and the bytes.

`store` is the reader's seam (`DatasetStore`, `open_dataset`); `local` is a folder on this
machine and the operating-system plumbing the compiler writes with; `s3` a dataset in an
S3-compatible bucket, read through a node-local cache (imported only for an s3:// URL).
"""

from dsc.storage.store import (
    DatasetStore,
    OpenedDataset,
    check_manifest_text,
    check_skip_list,
    dataset_versions,
    files_of_versions,
    is_dataset,
    is_url,
    open_dataset,
    parse_manifest,
    read_skipped,
    read_warnings,
    stored_and_skipped,
    validate,
    verify_checksums,
)

__all__ = ["DatasetStore", "OpenedDataset", "open_dataset", "validate", "parse_manifest", "read_skipped",
           "read_warnings", "check_skip_list", "check_manifest_text",
           "dataset_versions", "files_of_versions", "stored_and_skipped", "is_dataset", "is_url", "verify_checksums"]

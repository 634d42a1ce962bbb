"""Storage: where a dataset's files are, between the format (`dsc.format`) and the bytes.

`store` is the reader's seam (`DatasetStore`, `open_dataset`); `local` is a folder on this
machine and the operating-system plumbing the compiler writes with; `s3` a dataset in an
S3-compatible bucket (imported only for an s3:// URL), its index cached whole and its records read
through `cache`, a bounded node-local cache that follows the epoch's order, whose files are `units`;
`manifest_copies` the node's copies of its manifests; `fetch_helper` makes the requests of a process
forked after obstore started; `aws_config` reads the AWS profile files.
"""

from dsc.storage.store import (
    DatasetStore,
    OpenedDataset,
    check_manifest_text,
    check_skip_list,
    class_counts,
    dataset_versions,
    files_of_versions,
    is_dataset,
    is_url,
    open_dataset,
    parse_manifest,
    read_skipped,
    read_warnings,
    record_checksums,
    stored_and_skipped,
    validate,
    verify_checksums,
)

__all__ = ["DatasetStore", "OpenedDataset", "open_dataset", "validate", "parse_manifest", "read_skipped",
           "read_warnings", "class_counts", "record_checksums", "check_skip_list", "check_manifest_text",
           "dataset_versions", "files_of_versions", "stored_and_skipped", "is_dataset", "is_url", "verify_checksums"]

"""Where a run's files live: local folders or object stores (s3://, gs://, az://) through fsspec.

The ``[cloud]`` extra installs the backends (s3fs, gcsfs, adlfs). ``checkpoint/`` stages and publishes
checkpoints through this room; ``monitor/`` and ``profile/`` write their run files through it.
"""

from lightning_accel.storage.node_cache import (
    CACHE_ENV,
    cache_root,
    download_dir,
    fetch_once_per_node,
    node_lock,
    staging_dir,
)
from lightning_accel.storage.retries import Backoff, OutageLog, StoreError, retrying
from lightning_accel.storage.transfer import (
    abort_stale_uploads,
    confirm_upload,
    download,
    download_tree,
    for_uploads,
    remove_objects,
    store_checks_crc32,
    upload,
)
from lightning_accel.storage.trust import parse_json_object
from lightning_accel.storage.urls import (
    CLOUD_EXTRA,
    MissingStorageBackend,
    UnsupportedStorageError,
    check_storage_url,
    filesystem,
    is_remote,
    join,
    redact,
)

__all__ = [
    "CACHE_ENV",
    "CLOUD_EXTRA",
    "Backoff",
    "MissingStorageBackend",
    "OutageLog",
    "StoreError",
    "UnsupportedStorageError",
    "abort_stale_uploads",
    "cache_root",
    "check_storage_url",
    "confirm_upload",
    "download",
    "download_dir",
    "download_tree",
    "fetch_once_per_node",
    "filesystem",
    "for_uploads",
    "is_remote",
    "join",
    "node_lock",
    "parse_json_object",
    "redact",
    "remove_objects",
    "retrying",
    "staging_dir",
    "store_checks_crc32",
    "upload",
]

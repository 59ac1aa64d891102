"""Where a run's files go: a local folder or an object-store URL (``s3://``, ``gs://``, ``az://``), through fsspec.

fsspec is the storage layer Lightning itself uses (``ModelCheckpoint(dirpath="s3://...")``); its backends s3fs,
gcsfs and adlfs take credentials from each cloud's standard chain (AWS variables, profile or instance role; GCP
application default credentials; Azure variables). Nothing here reads, stores or logs a credential: URLs are
shown through :func:`redact`, which drops any ``user:secret@`` part.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import fsspec
from fsspec import AbstractFileSystem
from fsspec.registry import known_implementations

from lightning_accel.extras import MissingExtra, pip_install

__all__ = [
    "CLOUD_EXTRA",
    "MissingStorageBackend",
    "UnsupportedStorageError",
    "check_storage_url",
    "filesystem",
    "is_remote",
    "join",
    "redact",
    "url_hash",
]

CLOUD_EXTRA = pip_install("cloud")
# Schemes a local path may carry: they stay local paths.
_LOCAL_SCHEMES = {"file", "local"}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# The object stores the [cloud] extra installs a backend for, and the package behind each.
_CLOUD_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


class UnsupportedStorageError(ValueError):
    """A URL whose scheme has no fsspec backend installed here, or no known backend at all."""


class MissingStorageBackend(UnsupportedStorageError, MissingExtra):
    """An object store's backend (s3fs, gcsfs, adlfs) is not installed: the [cloud] extra installs it."""

    def __init__(self, message: str, package: str) -> None:
        MissingExtra.__init__(self, "object storage", "cloud", package, message)


def scheme_of(path: str | os.PathLike[str]) -> str | None:
    match = _SCHEME.match(str(path))
    return match.group(1).lower() if match else None


def is_remote(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL of a store other than the local file system (``file://`` counts as local)."""
    if path is None or isinstance(path, Path):  # a Path has lost its "//": never a URL
        return False
    scheme = scheme_of(path)
    return scheme is not None and scheme not in _LOCAL_SCHEMES


def redact(url: str | os.PathLike[str]) -> str:
    """``url`` without any ``user:password@`` part, for logs and errors."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", str(url))


def check_storage_url(url: str | os.PathLike[str], what: str = "dirpath") -> None:
    """Raise :class:`UnsupportedStorageError` now, before training, if ``url`` cannot be written here.

    A scheme fsspec does not know, or one whose backend is not installed, gets one line naming the value and the
    package to install. Local paths pass untouched.
    """
    if not is_remote(url):
        return
    scheme = scheme_of(url)
    assert scheme is not None
    if scheme not in known_implementations:
        raise UnsupportedStorageError(
            f"{what}={redact(url)!r}: no storage backend is known for the scheme {scheme + '://'!r}. Use a local "
            "folder, or an object store: s3://, gs:// or az:// (" + CLOUD_EXTRA + ")"
        )
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as err:
        package = _CLOUD_BACKENDS.get(scheme)
        message = f"{what}={redact(url)!r}: the {scheme}:// backend is not installed. Fix: "
        if package:
            raise MissingStorageBackend(message + f"{CLOUD_EXTRA} (it installs {package})", package) from None
        raise UnsupportedStorageError(message + f"install the backend fsspec names: {err}") from None


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec file system of ``url`` and the path inside it (no scheme), credentials from the standard chain."""
    check_storage_url(url)
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def join(url: str, *names: str) -> str:
    """``url`` with ``names`` appended by ``/`` (an object key is not a local path: no ``os.sep``)."""
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def url_hash(url: str) -> str:
    """A short stable name for a URL, for its local staging and cache folders."""
    return hashlib.sha1(redact(url).rstrip("/").encode()).hexdigest()[:16]

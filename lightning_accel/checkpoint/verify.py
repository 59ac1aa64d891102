"""Is this checkpoint complete? One entry, :func:`verify`, for single files and sharded folders alike."""

from __future__ import annotations

import zipfile
from pathlib import Path

from lightning_accel.checkpoint.durable import CHECKSUM, PathLike, Verdict, file_digest, manifest_path, read_manifest
from lightning_accel.checkpoint.sharded import verify_folder


def _verify_zip(path: Path, why: str) -> Verdict:
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        return Verdict(False, f"{why}; not a readable torch checkpoint ({err})", "zip")
    if bad:
        return Verdict(False, f"{why}; corrupt member {bad}", "zip")
    return Verdict(True, f"{why}; the zip container and its CRCs are intact", "zip")


def verify(path: PathLike, checksum: bool = True) -> Verdict:
    """Check that ``path`` is a complete checkpoint (a file, or a sharded folder: see ``sharded.verify_folder``).

    With a manifest, size and checksum must match (``checksum=False`` checks the size only). Without a
    usable manifest (missing, unreadable, or a file another tool wrote), the zip container torch uses
    must be readable end to end with matching CRCs, which catches truncation and most corruption.
    """
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint folder
        return verify_folder(path, read_manifest(path), checksum)
    if not path.is_file():
        return Verdict(False, "missing", "size")
    manifest = read_manifest(path)
    if manifest is None:
        why = "unreadable manifest" if manifest_path(path).exists() else "no manifest"
        return _verify_zip(path, why)
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return Verdict(False, f"size {size} != {manifest.get('bytes')} recorded in the manifest (truncated?)", "size")
    if not checksum:
        return Verdict(True, checked_by="size")
    kind, label = (CHECKSUM, "xxh3-64 checksum") if CHECKSUM in manifest else ("sha256", "SHA-256")
    if file_digest(path, kind) != manifest.get(kind):
        return Verdict(False, f"{label} does not match the manifest (file altered or torn)", kind)
    return Verdict(True, checked_by=kind)

"""Is this checkpoint complete? One entry, :func:`verify`, for single files and sharded folders alike."""

from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from pathlib import Path

from lightning_accel.checkpoint.durable import (
    CHECKSUM,
    PathLike,
    Verdict,
    file_digest,
    manifest_path,
    parse_manifest,
    read_manifest,
)
from lightning_accel.checkpoint.sharded import verify_folder
from lightning_accel.storage import cache_root, node_lock, parse_json_object

__all__ = ["manifest_damage", "verified_once_per_node", "verify"]


def _verify_zip(path: Path, why: str) -> Verdict:
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    # a hostile file can make the zip reader fail in any of these ways: each is "not a usable checkpoint"
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError, zlib.error) as err:
        return Verdict(False, f"{why}; not a readable torch checkpoint ({err})", "zip")
    if bad:
        return Verdict(False, f"{why}; corrupt member {bad}", "zip")
    return Verdict(True, f"{why}; the zip container and its CRCs are intact", "zip")


def manifest_damage(path: Path) -> str | None:
    """What is wrong with the manifest beside a checkpoint file, in words; ``None`` when it is usable.

    One policy for all damage (not JSON, not an object, an object without the size or the checksum): the manifest
    is not trusted, and the checkpoint is judged by its own zip container instead.
    """
    where = manifest_path(path)
    if not where.exists():
        return "no manifest"
    try:
        data = where.read_bytes()
    except OSError as err:
        return f"unreadable manifest ({err.strerror})"
    text = data.decode("utf-8", errors="replace")
    manifest = parse_manifest(data)
    if manifest is None:
        return f"unreadable manifest (not a JSON object: {data[:40]!r})"
    if not isinstance(manifest.get("bytes"), int):
        return f"unreadable manifest (no size recorded: {text[:60]!r})"
    if not any(isinstance(manifest.get(kind), str) for kind in (CHECKSUM, "sha256")):
        return f"unreadable manifest (no checksum recorded: {text[:60]!r})"
    return None


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
    damage = manifest_damage(path)
    if damage is not None:
        return _verify_zip(path, damage)
    manifest = read_manifest(path)
    assert manifest is not None  # manifest_damage read it as an object
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return Verdict(False, f"size {size} != {manifest.get('bytes')} recorded in the manifest (truncated?)", "size")
    if not checksum:
        return Verdict(True, checked_by="size")
    kind, label = (CHECKSUM, "xxh3-64 checksum") if CHECKSUM in manifest else ("sha256", "SHA-256")
    if file_digest(path, kind) != manifest.get(kind):
        return Verdict(False, f"{label} does not match the manifest (file altered or torn)", kind)
    return Verdict(True, checked_by=kind)


def verified_once_per_node(path: Path) -> Verdict:
    """:func:`verify`, done by the first process of this node to ask about ``path`` as it is now (its size and
    modification time): the others wait on a lock and read its verdict, so eight ranks on a node read a checkpoint
    once, not eight times. A verdict file that cannot be trusted is verified again. A sharded folder is verified as
    it is each time (its files by size, its metadata by checksum: no model-sized read), since a shard changed in
    place leaves the folder's own size and time as they were."""
    if not path.is_file():
        return verify(path)
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    record = cache_root() / "verdicts" / f"{key}.json"
    with node_lock(record.with_suffix(".lock")):
        try:
            saved = parse_json_object(record.read_bytes())
        except OSError:
            saved = None
        if saved is not None and isinstance(saved.get("ok"), bool):
            return Verdict(saved["ok"], str(saved.get("reason", "")), str(saved.get("checked_by", "")))
        verdict = verify(path)
        record.write_text(json.dumps({"ok": verdict.ok, "reason": verdict.reason, "checked_by": verdict.checked_by}))
        return verdict

"""What a bucket holds: this project's checkpoint manifests in it, and whether the objects one names are all there.

Shared by the writer's retention (:mod:`lightning_accel.checkpoint.bucket`) and the reader's resume
(:mod:`lightning_accel.checkpoint.bucket_resume`). A manifest is only read as JSON; what it says is trusted only once
its objects are confirmed in the store with their sizes.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.durable import MANIFEST_SUFFIX, parse_manifest
from lightning_accel.storage import join, redact
from lightning_accel.storage.shards import folder_entries

__all__ = ["confirm_objects", "list_bucket_manifests"]


def list_bucket_manifests(fs: Any, root: str, pattern: str = "*.ckpt") -> list[tuple[int, str, dict[str, Any]]]:
    """(global step, checkpoint name, manifest) of every checkpoint whose manifest in the bucket can be trusted
    as a manifest; undecodable ones are skipped with a warning."""
    fs.invalidate_cache(root)
    found = []
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    for manifest_name in names:
        if not manifest_name.endswith(MANIFEST_SUFFIX):
            continue
        name = manifest_name[: -len(MANIFEST_SUFFIX)]
        if not fnmatch.fnmatch(name, pattern):
            continue
        manifest = parse_manifest(fs.cat_file(join(root, manifest_name)))
        if manifest is None:
            rank_zero_warn(f"Skipping checkpoint {name} in {redact(root)}: its manifest is not readable JSON")
            continue
        step = manifest.get("global_step")
        found.append((step if isinstance(step, int) else -1, name, manifest))
    return found


def confirm_objects(fs: Any, root: str, name: str, manifest: dict[str, Any]) -> str | None:
    """``None`` when every object the manifest names is in the store with its size; else what is wrong."""
    try:
        if manifest.get("kind") == "folder":
            entries = folder_entries(manifest)
            if entries is None:
                return "its manifest's list of files is not one of ours (not trusted)"
            for rel, entry in entries.items():
                size = fs.info(join(root, name, rel)).get("size")
                if size != entry["bytes"]:
                    return f"{rel}: {size} bytes in the store, {entry['bytes']} in the manifest"
            return None
        size = fs.info(join(root, name)).get("size")
    except FileNotFoundError:
        return "an object the manifest names is missing from the store"
    return None if size == manifest.get("bytes") else f"{size} bytes in the store, {manifest.get('bytes')} recorded"

"""One policy for every file or value the suite reads back (manifests, run files, heartbeats): bytes that do not
decode to what was written are *not trusted*, never a traceback from deep inside a parser.

A torn write, a bad sector or a hostile edit can leave any bytes: undecodable UTF-8, text that is not JSON, JSON of
another shape, or nesting deep enough to exhaust the parser's recursion. Each reads as ``None`` here; the caller
decides what "not trusted" means for it (skip a checkpoint's manifest and judge the file by its zip CRCs, count no
lost work, refuse with a clear line).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_json_object"]


def parse_json_object(data: bytes | str) -> dict[str, Any] | None:
    """``data`` as a JSON object, or ``None`` for anything else."""
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return value if isinstance(value, dict) else None

"""Housekeeping of the GGUF conversion cache (``<cache>/gguf``, see ``gguf.py``): the lock around a
conversion, and removing what no later start can use, so that the cache holds one conversion of each
file and set of options rather than one more every time the file or the converter changes.

An entry is ``<stem>-<key>/`` with its marker (``MARKER``: the source's path, size and mtime, the dtype,
the keep-quantized choice, the converter version) written last; ``.<entry>.lock`` beside it serialises
its conversion; ``.tmp-*`` directories are conversions in flight."""

import json
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


@contextmanager
def lock(path: Path):
    """An exclusive lock across processes (POSIX flock; elsewhere none: the rename alone keeps entries whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_temps(root: Path, max_age_s: float = 86400) -> None:
    """Temp dirs of conversions that crashed (a live one is younger than a day, and holds the lock)."""
    for tmp in root.glob(".tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def remove_superseded(root: Path, entry: Path, marker: str) -> list[Path]:
    """Remove the entries (and their lock files) that ``entry`` supersedes: conversions of the same source
    file with the same dtype and keep-quantized choice, made by an older converter, or by this converter
    from the file as it was before (another size or mtime). Entries of a newer converter (a newer install
    sharing the cache) are left alone, so two installs never remove each other's. Returns the removed."""
    mine = json.loads((entry / marker).read_text())
    removed = []
    for other in root.iterdir():
        if other == entry or other.name.startswith(".") or not other.is_dir():
            continue
        try:
            theirs = json.loads((other / marker).read_text())
        except (OSError, ValueError):
            continue  # not an entry, or one never finished (its conversion replaces it)
        same = all(theirs.get(k) == mine[k] for k in ("source", "dtype", "keep_quantized"))
        version = theirs.get("converter_version", 0)
        older = version < mine["converter_version"] or (
            version == mine["converter_version"] and (theirs.get("size"), theirs.get("mtime_ns")) != (mine["size"], mine["mtime_ns"]))
        if same and older:
            shutil.rmtree(other, ignore_errors=True)
            (root / f".{other.name}.lock").unlink(missing_ok=True)
            removed.append(other)
    if removed:
        log.info("removed %d superseded conversion(s) of %s from the cache: %s", len(removed), mine["source"],
                 ", ".join(p.name for p in removed))
    return removed

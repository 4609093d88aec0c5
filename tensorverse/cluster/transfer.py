"""Moving a directory between machines as bytes: a run directory from the node that ran a point
back to the driver, the corpus from the driver to the node.

An uncompressed tar: the run's LMDB store holds codec blobs that are already compressed, so zstd
would spend a core for little. Extraction uses tarfile's ``data`` filter (no absolute paths, no
links out of the directory, no devices), and a run directory is installed by renaming a fully
extracted staging directory into place, so ``OUT/runs/<key>`` is either absent or complete.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import uuid
from pathlib import Path

__all__ = ["pack_dir", "unpack_dir", "install_run_dir"]


def pack_dir(path: str | Path) -> bytes:
    """The directory's files as an uncompressed tar (names relative to ``path``)."""
    path = Path(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(path.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(path)), recursive=False)
    return buf.getvalue()


def unpack_dir(blob: bytes, dest: str | Path) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(dest, filter="data")
    return dest


def install_run_dir(runs: Path, key: str, *, blob: bytes | None = None, src: str | Path | None = None) -> Path:
    """Put a finished run directory at ``runs/<key>``: from tar bytes (``blob``) or by moving a
    directory another node wrote on a shared filesystem (``src``). Whatever was at ``runs/<key>``
    (an unfinished earlier attempt: a finished one is never run again) is replaced."""
    runs.mkdir(parents=True, exist_ok=True)
    final = runs / key
    staging = runs / f".incoming-{key}-{uuid.uuid4().hex[:8]}"
    if blob is not None:
        unpack_dir(blob, staging)
    elif src is not None:
        shutil.move(str(src), str(staging))  # a rename when on the same filesystem
    else:
        raise ValueError("install_run_dir: blob or src")
    if final.exists():
        old = runs / f".old-{key}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(staging, final)
    return final

"""A file outside Ollama's store (of the models directory, the demo) made a blob of it, for /api/copy and
/api/create from it: hard-linked where that keeps the store's promise that a blob is the bytes of its
digest, else copied as Ollama copies, and the log says which and why."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from .store_write import blob_path, inside, store_root, write_blob, write_failed

logger = logging.getLogger("pebbling")


def import_file(path: Path, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """A file outside the store (of the models directory, the demo) made a blob of it; its layer fields
    {digest, size}. A read-only file is hard-linked in where the file system allows (no second copy of a
    model of gigabytes), any other copied, as Ollama copies; the log says which, and why.

    A hard link is the file itself under a second name: an edit of the file in place would change the
    blob's bytes and leave it named by a digest they no longer have, which the store never allows (Ollama
    would serve it, and push it, as the model it was). So only a file that nobody may write (no write
    permission bit) is linked: editing it then needs its mode changed first, a deliberate act, where
    `cp other.gguf models/x.gguf` onto a writable file would rewrite the blob silently. (A copy-on-write
    clone, FICLONE on btrfs or XFS, would be safe for any file; Python has no portable call for it.) The
    link is hashed through its own name and checked unchanged after (size, mtime, inode, mode), so the
    digest is that of the bytes the blob holds."""
    st = path.stat()
    if st.st_mode & 0o222:
        why = "it is writable, and a link would let an edit of it change the store's blob (chmod a-w to link it)"
    else:
        layer, why = _link_blob(path, st, root)
        if layer is not None:
            logger.info("model store: linked %s into blob %s (a hard link to the read-only file; no copy)",
                        path.name, layer["digest"][:19])
            return layer
    with open(path, "rb") as f:
        layer = write_blob(iter(lambda: f.read(1 << 20), b""), root)
    logger.info("model store: copied %s into blob %s (%d bytes): not linked, %s", path.name, layer["digest"][:19],
                layer["size"], why)
    return layer


def _link_blob(path: Path, st: os.stat_result, root: str | os.PathLike | None) -> tuple[dict[str, Any] | None, str]:
    """({digest, size} of `path` hard-linked in as its blob, "") or (None, why it was not)."""
    tmp = inside(store_root(root) / "blobs" / f".new-{secrets.token_hex(6)}", root)
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, tmp)  # a link in the models directory: its file
    except OSError as exc:
        return None, ("the store is on another file system" if exc.errno == errno.EXDEV
                      else f"the file system refused a link ({exc.strerror or exc})")
    try:
        hasher, size = hashlib.sha256(), 0
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                hasher.update(chunk)
                size += len(chunk)
            after = os.fstat(f.fileno())
        if (after.st_ino, after.st_size, after.st_mtime_ns, after.st_mode) != \
                (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode) or size != st.st_size:
            return None, "it changed while it was read"
        digest = f"sha256:{hasher.hexdigest()}"
        os.replace(tmp, blob_path(digest, root))  # a blob already there is the same bytes
    except OSError as exc:
        raise write_failed(exc, f"a link to a file of {st.st_size} bytes") from None
    finally:
        tmp.unlink(missing_ok=True)
    return {"digest": digest, "size": size}, ""

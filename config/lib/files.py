"""Stored copies (run inputs, webhook attachments, mail, SQLite files): private to the service, names that fit.

Files are created 0600 and directories 0700 whatever the process umask — every folder this
creates on the way, not only the last — so no other account on the host (its group included)
reads what users uploaded, the mail it wrote, or the SQLite database (API tokens, sessions). The name on disk is the user's name shortened to fit
the file system (255 bytes per name, with room for the `.partial` suffix used while writing);
the full name is kept in the database, so shortening never loses what the user called the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
DIR_MODE = 0o700
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")
# Room under the usual 255-byte limit for ".partial" and a short digest.
MAX_DISK_NAME_BYTES = 200


def disk_name(name: str) -> str:
    """`name` if it fits, else a prefix of it plus a digest of the whole, keeping its extension."""
    encoded = name.encode("utf-8")
    if len(encoded) <= MAX_DISK_NAME_BYTES:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:12]
    stem, dot, extension = name.rpartition(".")
    suffix = f".{extension}" if dot and stem and len(extension.encode()) <= 16 else ""
    if not suffix:
        stem = name
    room = MAX_DISK_NAME_BYTES - len(suffix.encode()) - len(digest) - 1
    # Cut at a character boundary: never half a multi-byte character.
    prefix = stem.encode("utf-8")[:room].decode("utf-8", "ignore")
    return f"{prefix}-{digest}{suffix}"


def make_private_dir(path: Path, *, exist_ok: bool = True) -> None:
    """`path` as a private directory; each missing folder above it is created private too."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(folder, DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened
    path.mkdir(mode=DIR_MODE, exist_ok=exist_ok)
    os.chmod(path, DIR_MODE)


def make_sqlite_files_private(sender=None, connection=None, **kwargs) -> None:
    """connection_created: the SQLite database and its WAL, shared-memory and journal files, 0600.

    SQLite creates the database with the umask's mode (0644 by default) and its -wal and -shm
    files with the database's, so narrowing the database (and whatever of the rest exists) each
    time a connection opens keeps all of them private.
    """
    if connection is None or connection.vendor != "sqlite":
        return
    name = str(connection.settings_dict.get("NAME") or "")
    if not name or name == ":memory:" or name.startswith("file:"):
        return
    for suffix in SQLITE_SUFFIXES:
        try:
            os.chmod(name + suffix, FILE_MODE)
        except FileNotFoundError:
            continue


def open_private(path: Path) -> IO[bytes]:
    """A new file for writing, readable by the service's account and group only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb")

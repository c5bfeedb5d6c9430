"""Stored copies (run inputs, webhook attachments): private to the service, names that fit.

Files are created 0640 and directories 0750 whatever the process umask, so other accounts on
the host cannot read what users uploaded. The name on disk is the user's name shortened to fit
the file system (255 bytes per name, with room for the `.partial` suffix used while writing);
the full name is kept in the database, so shortening never loses what the user called the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO

FILE_MODE = 0o640
DIR_MODE = 0o750
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=DIR_MODE, exist_ok=exist_ok)
    os.chmod(path, DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened


def open_private(path: Path) -> IO[bytes]:
    """A new file for writing, readable by the service's account and group only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb")

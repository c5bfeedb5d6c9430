"""The default mail backend: Django's file backend, with the folder and every file private.

Django's backend creates its folder and files with the umask's modes (0755 and 0644 by default),
so any account on the host could read every message the agents sent.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.core.mail.backends.filebased import EmailBackend

from config.lib.files import DIR_MODE, FILE_MODE, make_private_dir


class PrivateFileEmailBackend(EmailBackend):
    def __init__(self, *args, file_path=None, **kwargs):
        folder = Path(os.path.abspath(file_path if file_path is not None else settings.EMAIL_FILE_PATH))
        if not folder.exists():
            make_private_dir(folder)  # before Django's makedirs, which would use the umask's mode
        super().__init__(*args, file_path=file_path, **kwargs)
        os.chmod(self.file_path, DIR_MODE)  # a folder an earlier version created 0755 too

    def open(self):
        if self.stream is None:
            fd = os.open(self._get_filename(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
            os.fchmod(fd, FILE_MODE)
            self.stream = os.fdopen(fd, "ab")
            return True
        return False

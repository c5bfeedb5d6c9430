"""Upload handlers that keep the name a client sent, whole.

Django's uploaded file cuts a name longer than 255 characters to fit (keeping its extension), so
a door that checks the name (`runs.inputs.run_input.clean_file_name`) would check and store a name the
client never sent. These handlers are Django's two, and also keep the name as sent in
`name_as_sent`: a door refuses a name over the limit instead of storing a silently shortened one.
"""

from __future__ import annotations

from django.core.files.uploadhandler import MemoryFileUploadHandler, TemporaryFileUploadHandler


def name_as_sent(upload) -> str:
    """The name the client sent for `upload` (the handlers' record, else the file's own name)."""
    return getattr(upload, "name_as_sent", None) or upload.name


class _KeepsName:
    def file_complete(self, file_size):
        uploaded = super().file_complete(file_size)
        if uploaded is not None:
            uploaded.name_as_sent = self.file_name
        return uploaded


class NameKeepingMemoryFileUploadHandler(_KeepsName, MemoryFileUploadHandler):
    pass


class NameKeepingTemporaryFileUploadHandler(_KeepsName, TemporaryFileUploadHandler):
    pass

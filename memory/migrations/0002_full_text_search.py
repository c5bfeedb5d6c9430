"""The full-text index of memories: a GIN expression index on PostgreSQL, FTS5 on SQLite.

Neither is part of Django's model state (they differ per database); see memory.fulltext.
"""

from django.contrib.postgres.operations import BtreeGinExtension
from django.db import migrations

from memory import fulltext


def forwards(apps, schema_editor):
    fulltext.install(schema_editor)


def backwards(apps, schema_editor):
    fulltext.uninstall(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memory", "0001_initial")]

    operations = [
        # Lets the GIN index hold the scope columns; a no-op on SQLite. Trusted since
        # PostgreSQL 13, so the database owner may create it without being a superuser.
        BtreeGinExtension(),
        migrations.RunPython(forwards, backwards),
    ]

# API tokens named by a key prefix in the admin (a proxy of DRF's Token), and webhook sources'
# shared secrets encrypted at rest (config/lib/crypto.py): the column becomes text, then every
# stored secret is encrypted under SECRETS_ENCRYPTION_KEYS' first key.

import django.core.validators
from django.db import migrations

import config.lib.crypto


def _rewrite(schema_editor, apps, change) -> None:
    table = apps.get_model("runs", "WebhookSource")._meta.db_table
    quoted = schema_editor.quote_name(table)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"SELECT id, secret FROM {quoted}")
        for pk, stored in cursor.fetchall():
            new = change(stored or "")
            if new != stored:
                cursor.execute(f"UPDATE {quoted} SET secret = %s WHERE id = %s", [new, pk])


def encrypt_secrets(apps, schema_editor) -> None:
    _rewrite(schema_editor, apps, config.lib.crypto.rotated)


def decrypt_secrets(apps, schema_editor) -> None:
    _rewrite(schema_editor, apps, lambda stored: config.lib.crypto.decrypt(stored) if stored else stored)


class Migration(migrations.Migration):

    dependencies = [
        ("authtoken", "0004_alter_tokenproxy_options"),
        ("runs", "0013_recovery"),
    ]

    operations = [
        migrations.CreateModel(
            name="ApiToken",
            fields=[],
            options={
                "verbose_name": "API token",
                "verbose_name_plural": "API tokens",
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("authtoken.token",),
        ),
        migrations.AlterField(
            model_name="webhooksource",
            name="secret",
            field=config.lib.crypto.EncryptedTextField(validators=[django.core.validators.MaxLengthValidator(255)]),
        ),
        migrations.RunPython(encrypt_secrets, decrypt_secrets),
    ]

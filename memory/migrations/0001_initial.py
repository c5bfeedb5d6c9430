import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='MemoryEntry',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('agent_name', models.CharField(max_length=128)),
                ('owner_id', models.CharField(max_length=128)),
                ('event_id', models.CharField(max_length=128)),
                ('author', models.CharField(max_length=128)),
                ('text', models.TextField()),
                ('session_id', models.CharField(blank=True, max_length=128)),
                ('run_id', models.UUIDField(blank=True, null=True)),
                ('timestamp', models.DateTimeField(help_text='When the remembered event happened.')),
                ('added_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'verbose_name': 'memory',
                'verbose_name_plural': 'memories',
                'db_table': 'memory_entries',
                'ordering': ['-timestamp', '-id'],
                'indexes': [models.Index(fields=['agent_name', 'owner_id', '-timestamp'], name='memory_scope_time'), models.Index(fields=['owner_id'], name='memory_owner'), models.Index(fields=['timestamp'], name='memory_time'), models.Index(fields=['run_id'], name='memory_run')],
                'constraints': [models.UniqueConstraint(fields=('agent_name', 'owner_id', 'event_id'), name='memory_scope_event')],
            },
        ),
    ]

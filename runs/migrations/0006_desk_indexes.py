# The desk overview's indexes and the run's trace id (Django 5.2.19).

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0005_merge'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='trace_id',
            field=models.CharField(blank=True, max_length=32),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(fields=['created_at', 'status', 'trigger'], name='run_created_status_trigger'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(fields=['error_code', 'finished_at'], name='run_error_code_finished'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('status__in', ['error', 'cancelled']), ('tools_executed__isnull', False), models.Q(('tools_executed', []), _negated=True)), fields=['run_id'], name='run_failed_tools_called'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('status__in', ['error', 'cancelled']), ('tools_executed__isnull', True)), fields=['run_id'], name='run_failed_tools_unknown'),
        ),
        migrations.AddIndex(
            model_name='schedulefiring',
            index=models.Index(fields=['outcome', 'fired_at'], name='firing_outcome_fired'),
        ),
        migrations.AddIndex(
            model_name='toolcall',
            index=models.Index(condition=models.Q(('status', 'called')), fields=['run'], name='toolcall_called_run'),
        ),
    ]

"""Input rules: what may be stored, pure of the runs models.

A run's input (`run_input`: agent, message, owner id, params, file names), a schedule's kinds,
cron, next slot and check (`schedules`), a webhook source's configuration (`sources`). The
models' `clean()` and `save()` call them, so they import no model of this app.
"""

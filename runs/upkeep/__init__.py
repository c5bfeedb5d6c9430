"""Upkeep: what keeps the ledger healthy without a person.

Recovery of dead runs (`recovery`), the purge of old events (`retention`), retention of what
was sent (`stored_data`), the Prometheus gauges and `/metrics` (`metrics`), and the periodic
jobs django-q2 runs (`periodic_jobs`; their entry points stay `runs.tasks`, names stored in
the database).
"""

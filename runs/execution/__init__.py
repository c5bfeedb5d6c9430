"""Executing one claimed run on the agent loop.

The executor (`executor`: claim, run, settle), the process's heartbeat thread (`heartbeat`)
and a run as one trace (`telemetry`). Chat turns, the inbox and the worker process call it.
"""

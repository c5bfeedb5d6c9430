"""Tests that start real processes, servers or a browser (runworker, crash points, ADK's and
A2A's wires, `serve`): multi-process behaviour, mostly on PostgreSQL.
"""

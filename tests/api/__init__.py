"""Tests of runs.api: the HTTP API, its schema and tokens.
"""

"""Chat: turns as runs in one conversation's session, streamed on the server's loop (`turns`).
A product that starts runs through `runs.services` and executes them with `runs.execution`.
"""

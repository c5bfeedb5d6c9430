"""The `runworker` process: its parent and its worker processes.

The parent that forks, watches and replaces worker processes, each process's claim loop, run
pool, drain and inbox loop (`processes`), and each process's sweep (`sweeper`). It sits above
the products because a worker process also works the webhook inbox.
"""

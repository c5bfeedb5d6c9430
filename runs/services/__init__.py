"""The services every door calls (API, admin, chat, commands, tasks, the inbox).

A run started, replayed, resumed or cancelled (`run`), and the decisions on a run's calls
(`decisions`): approving, rejecting or answering a call that waits, the timeout's rejection, and
settling a call in doubt. Each asks the rules, then writes.
"""

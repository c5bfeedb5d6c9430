"""The run ledger: one Django app (label `runs`) in rooms, one per job. Each room's docstring says
what it holds; `pyproject.toml`'s "Rooms inside runs" contract says which may import which
(a room imports only the rooms below it):

- doors: `admin` (the support desk), `api` (the HTTP API), `adkwire` (ADK's API server wire),
  `a2a` (A2A), `management` (commands), `tasks` (django-q2 entry points), `urls`, `apps`;
- `worker`: the `runworker` process;
- products that start runs: `inbox` (webhooks), `chat`, `schedules`; and `upkeep` (recovery,
  retention, metrics, periodic jobs);
- `execution` (running one claimed run) and `services` (what every door calls);
- `rules` (replay, resume, who may, who sees, the desk's sets);
- `ledger` (the record: lifecycle, leases, journal, effects and waits at call time, reconcile);
- `models`;
- `inputs` (what may be stored, pure of the models), `refusals` (the ledger's refusals) and
  `templatetags` (the desk's template filters).
"""

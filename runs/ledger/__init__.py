"""The record: what a run is and was.

A run's life in its worker (announce, claim, heartbeat, settle: `lifecycle`), the lease that
fences its writes (`leases`), the tool journal (`journal`), effects at call time (`effects`:
the plugin, intent ids and keys, effect records), calls that wait (`approvals`: parking, the
continuation), dead runs reconciled (`reconcile`), the replay/resume chain (`chain`), workflow
steps (`steps`), session events for people (`timeline`), what a run came to (`outcomes`), the
event counters (`counters`), waking the workers (`wakeup`) and who is alive (`presence`).
Imports only `runs.models`, `runs.refusals` and `runs.inputs` of this app: no rule, no service.
"""

"""The HTTP API (DRF) under `/api/`: runs and their calls (`runs`, `approvals`), chat (`chat`, a
streaming non-DRF view), memory (`memory`), webhooks (`webhooks`), their request and response
shapes (`serializers`) and routes (`urls`). A door: views call `runs.services` and translate
refusals once.
"""

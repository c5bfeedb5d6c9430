"""django-q2 task entry points: thin doors onto the services. Each is safe to run twice."""

import uuid

from runs import executor


def execute_run(run_id: str) -> str:
    return executor.execute(uuid.UUID(str(run_id)))

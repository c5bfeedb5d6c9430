"""The path and the query string are input too: `?owner_id=a%00b` must be a 400, not a database error.

PostgreSQL refuses NUL characters in text, so a NUL reaching a filter fails the query with a
500; the admin's search and filters, the runs list and the memory search all read the query
string, and URL path segments (a webhook source's slug, a workflow's name, a call id) become
lookups too. One middleware checks the decoded path and every name and value before any view
sees them.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from config.lib.middleware import refusing_middleware
from config.lib.safe_json import text_problem


def refusal_for(request: HttpRequest) -> HttpResponse | None:
    path_problem = text_problem(request.path)
    if path_problem is not None:
        return JsonResponse({"code": "invalid_path", "detail": f"The URL path {path_problem}."}, status=400)
    for name, values in request.GET.lists():
        for where, text in (
            (f"The query parameter name {name!r}", name),
            *((f"The query parameter {name}", v) for v in values),
        ):
            problem = text_problem(text)
            if problem is not None:
                return JsonResponse({"code": "invalid_query", "detail": f"{where} {problem}."}, status=400)
    return None


query_guard_middleware = refusing_middleware(refusal_for)

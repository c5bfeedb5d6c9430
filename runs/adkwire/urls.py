"""ADK's API server routes, under /adk/ (the root URLconf includes them by name)."""

from django.urls import path, re_path

from runs.adkwire import views

urlpatterns = [
    path("list-apps", views.list_apps, name="adk-list-apps"),
    path("run", views.run, name="adk-run"),
    path("run_sse", views.run_sse, name="adk-run-sse"),
    path("apps/<str:app_name>/users/<str:user_id>/sessions", views.sessions, name="adk-sessions"),
    path("apps/<str:app_name>/users/<str:user_id>/sessions/<str:session_id>", views.session, name="adk-session"),
    # Keep last: any other path under /adk/ answers as ADK's server does, {"detail": "Not Found"}.
    re_path(r"", views.adk_not_found),
]

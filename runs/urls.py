"""The ledger's pages outside the API: the desk overview (inside the admin) and /metrics."""

from django.contrib import admin
from django.urls import path

from runs.admin.overview import desk_overview
from runs.upkeep import metrics

urlpatterns = [
    # Inside /admin/ so the desk shares the admin's login, look and permissions.
    path("admin/desk/", admin.site.admin_view(desk_overview), name="desk_overview"),
    path("metrics", metrics.metrics_view, name="metrics"),
]

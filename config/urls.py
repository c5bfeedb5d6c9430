"""The root URLconf: the admin, the API under /api/, ADK's wire under /adk/ (each app's routes are its own)."""

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from config.lib.api_errors import api_not_found

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    # Before the admin's own routes: the desk overview lives under /admin/desk/.
    path("", include("runs.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("runs.api.urls")),
    # ADK's API server wire (its own paths and error shape, 404s included).
    path("adk/", include("runs.adkwire.urls")),
    # Keep last: any other path under /api/ answers a JSON 404.
    re_path(r"^api/", api_not_found),
]

handler400 = "config.lib.api_errors.api_bad_request"
handler500 = "config.lib.api_errors.api_server_error"

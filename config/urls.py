from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from memory.api import MemorySearchView
from runs.api.views import api_not_found
from runs.chat_views import chat_turn

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/memory/", MemorySearchView.as_view(), name="memory-search"),
    path("api/chat/", chat_turn, name="chat"),
    path("api/", include("runs.api.urls")),
    # Keep last: any other path under /api/ answers a JSON 404.
    re_path(r"^api/", api_not_found),
]

handler500 = "runs.api.exceptions.api_server_error"

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from memory.api import MemorySearchView
from runs.chat_views import chat_turn

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/memory/", MemorySearchView.as_view(), name="memory-search"),
    path("api/chat/", chat_turn, name="chat"),
]

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from memory.api import MemorySearchView

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/memory/", MemorySearchView.as_view(), name="memory-search"),
]

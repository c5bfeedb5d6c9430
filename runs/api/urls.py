from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import SimpleRouter

from agents.api import AgentViewSet, WorkflowViewSet
from runs.api.chat import chat_turn
from runs.api.memory import MemorySearchView
from runs.api.runs import RunViewSet
from runs.api.webhooks import WebhookReceiveView

router = SimpleRouter()
router.register("runs", RunViewSet, basename="run")
router.register("workflows", WorkflowViewSet, basename="workflow")
router.register("agents", AgentViewSet, basename="agent")

app_name = "api"

urlpatterns = [
    path("", include(router.urls)),
    path("memory/", MemorySearchView.as_view(), name="memory-search"),
    path("chat/", chat_turn, name="chat"),
    path("webhooks/<str:source>/", WebhookReceiveView.as_view(), name="webhook-receive"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api:schema"), name="docs"),
]

"""The A2A endpoints, `/a2a/{agent}` and its card, as the a2a-sdk's own Starlette routes serve them.

Laid out as ADK's `to_a2a(rpc_path=…)` lays one agent out: the JSON-RPC endpoint (the 1.0 methods
and the 0.3 names on one path, the SDK's `JsonRpcDispatcher` with its v0.3 adapter) and the card at
`{endpoint}/.well-known/agent-card.json` (the SDK's card route). `config/asgi.py` mounts this
application in front of Django for paths under `/a2a/`: the SDK's SSE responses and disconnect
handling then run as written, instead of being re-encoded into Django responses.

Authentication is the ledger's API token (`Authorization: Token <key>`, as the card says); the
card itself is public, as discovery documents are.
"""

from __future__ import annotations

from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.routes import create_agent_card_routes
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.types import AgentCapabilities, AgentCard
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from google.adk.a2a import _compat
from google.adk.a2a.utils.agent_card_builder import AgentCardBuilder
from rest_framework import exceptions as drf_exceptions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agents.registry import UnknownAgentError, get_agent_spec
from config.lib.auth import authenticate_key
from runs.a2a.handler import LedgerRequestHandler

SCHEME = "ledgerToken"
PREFIX = "/a2a/"


def _rpc_error(status: int, message: str, *, code: int = -32600, headers: dict | None = None) -> JSONResponse:
    # JSON-RPC's error object, with the HTTP status a client's transport reads first.
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}},
                        status_code=status, headers=headers)


def _user_of(key: str, address: str | None) -> Any:
    user, _token = authenticate_key(key, address=address)
    return user


async def authenticate(request: Request) -> Any:
    """The Django user of the request's API token; raises DRF's AuthenticationFailed with its sentence."""
    words = request.headers.get("authorization", "").split()
    if len(words) != 2 or words[0].lower() != "token":
        raise drf_exceptions.NotAuthenticated(
            "Authentication credentials were not provided: send Authorization: Token <your API token>."
        )
    return await sync_to_async(_user_of)(words[1], request.client.host if request.client else None)


class LedgerContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's call context, carrying the ledger's user (set by the application before dispatch)."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["ledger_user"] = request.scope["ledger_user"]
        return context


def _scheme() -> Any:
    scheme = _compat.make_api_key_scheme(name="Authorization", location="header")
    scheme.api_key_security_scheme.description = (
        "The ledger's API token, sent as 'Authorization: Token <key>' (manage.py drf_create_token, or the admin)."
    )
    return scheme


class Endpoints:
    """Each agent's card and JSON-RPC dispatcher, built on first use (per public base URL for the card)."""

    def __init__(self) -> None:
        self._cards: dict[tuple[str, str], AgentCard] = {}
        self._dispatchers: dict[str, JsonRpcDispatcher] = {}

    async def card(self, agent: str, base_url: str) -> AgentCard:
        key = (agent, base_url)
        if key not in self._cards:
            spec = get_agent_spec(agent)
            builder = AgentCardBuilder(
                agent=spec.root,
                rpc_url=f"{base_url}{PREFIX}{agent}",
                capabilities=AgentCapabilities(streaming=True),
                security_schemes={SCHEME: _scheme()},
            )
            card = await builder.build()
            card.name = agent
            card.description = spec.description or card.description
            requirement = card.security_requirements.add()
            requirement.schemes[SCHEME].SetInParent()
            self._cards[key] = card
        return self._cards[key]

    async def dispatcher(self, agent: str, base_url: str) -> JsonRpcDispatcher:
        if agent not in self._dispatchers:
            card = await self.card(agent, base_url)
            self._dispatchers[agent] = JsonRpcDispatcher(
                request_handler=LedgerRequestHandler(agent, card),
                context_builder=LedgerContextBuilder(),
                enable_v0_3_compat=True,
            )
        return self._dispatchers[agent]


ENDPOINTS = Endpoints()


def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _host_allowed(request: Request) -> bool:
    """Django's own ALLOWED_HOSTS rule: these routes are served before Django sees the request."""
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    host = request.headers.get("host", "")
    domain, _port = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed)


def _bad_host(request: Request) -> Response:
    return JSONResponse({"detail": f"Invalid Host header {request.headers.get('host', '')!r}: not in ALLOWED_HOSTS."},
                        status_code=400)


async def agent_card(request: Request) -> Response:
    if not _host_allowed(request):
        return _bad_host(request)
    agent = request.path_params["agent"]
    try:
        card = await ENDPOINTS.card(agent, _base_url(request))
    except UnknownAgentError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)
    # The SDK's own card route: its JSON for 1.0 and 0.3 readers, its ETag.
    route = create_agent_card_routes(card, card_url=request.url.path)[0]
    return await route.endpoint(request)


async def rpc(request: Request) -> Response:
    if not _host_allowed(request):
        return _bad_host(request)
    agent = request.path_params["agent"]
    try:
        user = await authenticate(request)
    except drf_exceptions.APIException as exc:
        return _rpc_error(401, str(exc.detail), code=-32001, headers={"WWW-Authenticate": "Token"})
    try:
        dispatcher = await ENDPOINTS.dispatcher(agent, _base_url(request))
    except UnknownAgentError as exc:
        return _rpc_error(404, str(exc), code=-32001)
    request.scope["ledger_user"] = user
    return await dispatcher.handle_requests(request)


async def not_found(request: Request) -> Response:
    return JSONResponse({"detail": f"Not Found: the A2A endpoints are {PREFIX}<agent> and "
                                   f"{PREFIX}<agent>/.well-known/agent-card.json."}, status_code=404)


application = Starlette(routes=[
    Route(PREFIX + "{agent}/.well-known/agent-card.json", agent_card, methods=["GET"]),
    Route(PREFIX + "{agent}", rpc, methods=["POST"]),
    Route(PREFIX + "{agent}/", rpc, methods=["POST"]),
    Route(PREFIX + "{rest:path}", not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
])


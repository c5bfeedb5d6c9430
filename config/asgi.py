import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django_application = get_asgi_application()

from django.utils.module_loading import import_string  # noqa: E402 - after Django is set up

from config.lib.limits import BodyLimitMiddleware  # noqa: E402 - reads settings, configured above
from config.lib.process import mark_web_process  # noqa: E402 - after Django is set up, like the handler

mark_web_process()

# A2A is served by the a2a-sdk's own Starlette routes (its SSE and disconnects as written), mounted
# here in front of Django for paths under /a2a/; named, like the URLconf's apps, not imported.
A2A_PREFIX = "/a2a/"
a2a_application = import_string("runs.a2a.app.application")


async def routed_application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith(A2A_PREFIX):
        return await a2a_application(scope, receive, send)
    return await django_application(scope, receive, send)


# In front of Django: Django's handler reads (and spools to disk) the whole body before any of
# its own middleware runs, so oversized bodies are refused here, while they stream in.
application = BodyLimitMiddleware(routed_application)

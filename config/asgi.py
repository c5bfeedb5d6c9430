import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django_application = get_asgi_application()

from config.lib.limits import BodyLimitMiddleware  # noqa: E402 - reads settings, configured above
from config.lib.process import mark_web_process  # noqa: E402 - after Django is set up, like the handler

mark_web_process()
# In front of Django: Django's handler reads (and spools to disk) the whole body before any of
# its own middleware runs, so oversized bodies are refused here, while they stream in.
application = BodyLimitMiddleware(django_application)

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

application = get_wsgi_application()

from config.lib.process import mark_web_process  # noqa: E402 - after Django is set up, like the handler

mark_web_process()

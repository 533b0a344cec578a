import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator.settings")
application = get_wsgi_application()

from . import extensions  # noqa: E402

# A WSGI server runs no system checks: a module of ORCH_EXTENSIONS that cannot be imported stops it here, named.
extensions.require()

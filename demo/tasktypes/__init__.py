"""The demo's task types: importing this module registers them (it is one of the extension's
modules, extensions.DEMO_MODULES)."""
from . import contracts, migrate_rows, notify, pipeline  # noqa: F401

"""An extension module that fails at import (tests/extensions/test_loading.py)."""
raise RuntimeError("the tracker's client needs TICKETS_TOKEN")

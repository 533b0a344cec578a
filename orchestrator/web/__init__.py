"""The server-rendered pages (the operator dashboard); orchestrator.urls routes to them."""

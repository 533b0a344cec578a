"""What the pages show, computed in Python and rendered by the templates: for the first
page load (orchestrator/web) and for live updates over the websockets (orchestrator/live.py),
which is why this package sits below both and imports neither."""

"""The demo workloads, written only against orchestrator.sdk as any extension is: the task types
demo.migrate_rows, demo.contracts, demo.notify and demo.pipeline (demo/tasktypes/), the agent's
read tools contracts_list and contracts_read (demo/tools.py), and the tables they write
(demo/models.py). On by default (ORCH_DEMO); the core never imports it (import-linter).

Kept empty: Django imports this package while it loads the apps, before models can be read;
the extension's modules are demo.tasktypes and demo.tools (extensions.DEMO_MODULES)."""

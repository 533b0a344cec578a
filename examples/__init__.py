"""Extensions written only against orchestrator.sdk, as an installation writes its own
(docs/extending.md). Load one with ORCH_EXTENSIONS, e.g. ORCH_EXTENSIONS=examples.tickets."""

from django.apps import AppConfig


class ReviewConfig(AppConfig):
    """The review queue: lists what the engine recorded as needing a person and decides it
    through the engine's services. Nothing to connect: the engine opens, expires and revokes
    its own records (orchestrator/engine/reviews.py) and never calls into this app."""
    name = "review"
    verbose_name = "Review queue"

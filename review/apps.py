from django.apps import AppConfig


class ReviewConfig(AppConfig):
    name = "review"
    verbose_name = "Review queue"

    def ready(self):
        from orchestrator.engine.approvals import approval_requested
        from orchestrator.engine.wal import effect_in_doubt

        from .services import open_for_approval, open_for_effect_in_doubt

        effect_in_doubt.connect(open_for_effect_in_doubt, dispatch_uid="review.open_for_effect_in_doubt")
        approval_requested.connect(open_for_approval, dispatch_uid="review.open_for_approval")

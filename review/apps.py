from django.apps import AppConfig


class ReviewConfig(AppConfig):
    name = "review"
    verbose_name = "Review queue"

    def ready(self):
        from orchestrator.engine.approvals import approval_requested, approvals_due, approvals_void
        from orchestrator.engine.wal import effect_in_doubt

        from .approvals import expire_due_approvals, revoke_approvals
        from .services import open_for_approval, open_for_effect_in_doubt

        effect_in_doubt.connect(open_for_effect_in_doubt, dispatch_uid="review.open_for_effect_in_doubt")
        approval_requested.connect(open_for_approval, dispatch_uid="review.open_for_approval")
        approvals_due.connect(expire_due_approvals, dispatch_uid="review.expire_due_approvals")
        approvals_void.connect(revoke_approvals, dispatch_uid="review.revoke_approvals")

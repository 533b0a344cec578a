from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "demo"
    label = "demo"
    verbose_name = "Demo workloads"
    default_auto_field = "django.db.models.BigAutoField"

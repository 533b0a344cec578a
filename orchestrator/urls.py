from django.contrib import admin
from django.urls import include, path

from .api import api
from .web import metrics, revisions, tasks

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/", api.urls),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("", tasks.task_list, name="task_list"),
    path("tasks/new/", tasks.task_new, name="task_new"),
    path("tasks/<int:task_id>/", tasks.task_detail, name="task_detail"),
    path("tasks/<int:task_id>/control/", tasks.task_control, name="task_control"),
    path("tasks/<int:task_id>/skip-step/", tasks.task_skip_step, name="task_skip_step"),
    path("tasks/<int:task_id>/send/", tasks.task_send_event, name="task_send_event"),
    path("tasks/<int:task_id>/edit/", revisions.task_edit, name="task_edit"),
    path("tasks/<int:task_id>/clone/", revisions.task_clone, name="task_clone"),
    path("tasks/<int:task_id>/rollback/<int:version>/", revisions.task_rollback, name="task_rollback"),
    path("review/", include("review.urls")),
]

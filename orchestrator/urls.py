from django.contrib import admin
from django.urls import include, path

from . import views
from .api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/", api.urls),
    path("", views.task_list, name="task_list"),
    path("tasks/new/", views.task_new, name="task_new"),
    path("tasks/<int:task_id>/", views.task_detail, name="task_detail"),
    path("tasks/<int:task_id>/control/", views.task_control, name="task_control"),
    path("tasks/<int:task_id>/skip-step/", views.task_skip_step, name="task_skip_step"),
    path("tasks/<int:task_id>/edit/", views.task_edit, name="task_edit"),
    path("tasks/<int:task_id>/clone/", views.task_clone, name="task_clone"),
    path("tasks/<int:task_id>/rollback/<int:version>/", views.task_rollback, name="task_rollback"),
    path("review/", include("review.urls")),
]

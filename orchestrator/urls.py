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
    path("review/", include("review.urls")),
]

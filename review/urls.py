from django.urls import path

from . import views

app_name = "review"

urlpatterns = [
    path("", views.review_list, name="queue"),
    path("<int:review_id>/", views.review_detail, name="detail"),
]

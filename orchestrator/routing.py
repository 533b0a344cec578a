from django.urls import path, re_path

from . import consumers

websocket_urlpatterns = [
    path("ws/tasks/", consumers.TaskListConsumer.as_asgi()),
    path("ws/tasks/<int:task_id>/", consumers.TaskConsumer.as_asgi()),
    re_path(r"", consumers.UnknownPathConsumer.as_asgi()),  # last: every other path is a clean refusal
]

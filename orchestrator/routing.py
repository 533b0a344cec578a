from django.urls import path

from . import consumers

websocket_urlpatterns = [
    path("ws/tasks/", consumers.TaskListConsumer.as_asgi()),
    path("ws/tasks/<int:task_id>/", consumers.TaskConsumer.as_asgi()),
]

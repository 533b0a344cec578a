"""Helper process for bench/live.py: `setup` prints the task, session and seq; `run ID`
drives the task like a worker would."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator.settings")
import orchestrator.settings as settings_module  # noqa: E402

settings_module.ORCH_EXTRA_TASK_TYPES = ["bench.benchtypes"]
import django  # noqa: E402

django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

from orchestrator.engine import services  # noqa: E402
from orchestrator.engine.worker import drive_inline  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "150"))
SLEEP_MS = int(os.environ.get("BENCH_STEP_MS", "40"))

if sys.argv[1] == "setup":
    call_command("migrate", verbosity=0)
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "b@x.org", "pw")
    client = Client()
    client.force_login(user)
    task = services.task_create(type="bench.chain", params={"steps": STEPS, "sleep_ms": SLEEP_MS},
                                limits={"max_subtasks": 1})
    print(json.dumps({"task_id": task.pk, "seq": task.event_seq, "session": client.cookies["sessionid"].value}))
else:
    print(drive_inline(int(sys.argv[2])), file=sys.stderr)

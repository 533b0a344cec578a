"""Hosts that die: three worker "hosts" (separate `qcluster` processes, each with its own
executors) on one PostgreSQL, many tasks in flight, and `kill -9` of a whole host's process
group, several times. For each kill: how long until every task the host held runs again
elsewhere (a new lease epoch, a live executor on another host), p50/p95 over all of them;
and, at the end, whether any step ran twice (fencing: two hosts never commit the same task).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_hosts .venv/bin/python bench/hosts.py
    BENCH_TASKS=1000 BENCH_KILLS=5 ORCH_STALE_AFTER_SECONDS=2 ...   (defaults: 1000, 5, 2)
    BENCH_BROKER=redis [BENCH_REDIS_URL=redis://127.0.0.1:6379/5]  (default: the ORM broker)
    BENCH_LOG_DIR=/tmp/hosts-logs   (the hosts' and the sweeper's INFO logs, one file each)
    ORCH_REQUEUE_AFTER_SECONDS=5    (the sweeper re-sends messages a dead host had prefetched)
    BENCH_RUN_AGAIN_WITHIN=30       (the bound counted in "tasks that failed to run again within 30 s")

The heartbeat is 1 s. A host's death is noticed by the sweeper when its tasks' heartbeats
are older than ORCH_STALE_AFTER_SECONDS, so that bounds the figure from below. Then a
recovered task needs a free worker slot: it goes before every queued task
(lease.claim_for_delivery), but the surviving hosts' slots are all busy, so it waits for one
of their runs to yield at a step boundary (lease.should_yield_to_recovered) and a new executor
to start. Both parts are printed. Prints figures; asserts nothing.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BROKER = os.environ.get("BENCH_BROKER", "orm")
if BROKER == "redis":  # settings: Q_CLUSTER uses Redis when REDIS_URL is set
    os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")
else:
    os.environ.pop("REDIS_URL", None)
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_hosts")
TASKS = int(os.environ.get("BENCH_TASKS", "1000"))
KILLS = int(os.environ.get("BENCH_KILLS", "5"))
STALE = os.environ.get("ORCH_STALE_AFTER_SECONDS", "2")
RUN_AGAIN_WITHIN = float(os.environ.get("BENCH_RUN_AGAIN_WITHIN", "30"))

from bench.measure import PgServer, host_of, pct  # noqa: E402

PgServer(os.environ["DATABASE_URL"]).ensure_database(PgServer(os.environ["DATABASE_URL"]).database)
from bench._django import setup  # noqa: E402

setup("hosts-bench", ORCH_HEARTBEAT_SECONDS="1", ORCH_STALE_AFTER_SECONDS=STALE, ORCH_MAX_RECOVERY_ATTEMPTS="1000",
      ORCH_REQUEUE_AFTER_SECONDS=os.environ.get("ORCH_REQUEUE_AFTER_SECONDS", "5"))

from django.db.models import Count  # noqa: E402

from orchestrator.engine import processes, services  # noqa: E402
from orchestrator.engine.states import TERMINAL, InvalidTransition  # noqa: E402
from orchestrator.models import Task, TaskEvent  # noqa: E402


LOG_DIR = os.environ.get("BENCH_LOG_DIR")  # the hosts' and the sweeper's logs (INFO) go there
spawned = 0


def spawn(*args, workers: int = 2) -> subprocess.Popen:
    global spawned
    spawned += 1
    out = open(Path(LOG_DIR) / f"{spawned:02d}-{args[0]}.log", "w") if LOG_DIR else subprocess.DEVNULL
    env = {**os.environ, "ORCH_WORKERS": str(workers), **({"ORCH_LOG_LEVEL": "INFO"} if LOG_DIR else {})}
    return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def held_by(host: subprocess.Popen, hosts) -> dict[int, tuple[int, str]]:
    """The running tasks whose executor belongs to `host`: {task id: (lease epoch, owner)}."""
    rows = Task.objects.filter(status="running").exclude(lease_owner="").exclude(worker_pid=None)
    return {t.pk: (t.lease_epoch, t.lease_owner) for t in rows.only("pk", "lease_epoch", "lease_owner", "worker_pid")
            if host_of(t.worker_pid, hosts) is host}


def prefetched() -> dict[int, tuple[int, object]]:
    """Tasks whose message some cluster has taken from the broker but that no worker has claimed
    (in a cluster's prefetch, django-q2's internal queue): {task id: (lease epoch, enqueued_at)}.
    The victim's die with it; only the sweeper's re-send gets them going
    (ORCH_REQUEUE_AFTER_SECONDS). Every hand-over to the broker stamps enqueued_at, so a task
    claimed with a newer stamp than at the kill ran from a message sent again (the dead host's lost
    ones are among those); one claimed with the same stamp ran from the message it had (a live
    host's prefetch, merely waiting in a busy cluster)."""
    from django.utils import timezone
    from django_q.signing import SignedPackage

    waiting = {pk: (epoch, enqueued_at) for pk, epoch, enqueued_at in
               Task.objects.filter(status__in=("queued", "running"), lease_owner="")
               .values_list("pk", "lease_epoch", "enqueued_at")}
    if BROKER == "redis":
        import redis

        listed = redis.Redis.from_url(os.environ["REDIS_URL"]).lrange("django_q:orchestrator:q", 0, -1)
        in_broker = {package["args"][0] for package in map(SignedPackage.loads, listed) if package.get("args")}
        return {pk: seen for pk, seen in waiting.items() if pk not in in_broker}
    from django_q.models import OrmQ

    packages = map(SignedPackage.loads, OrmQ.objects.filter(lock__gt=timezone.now()).values_list("payload", flat=True))
    taken = {package["args"][0] for package in packages if package.get("args")}  # schedules carry no task id
    return {pk: seen for pk, seen in waiting.items() if pk in taken}


def messages_of(task_id: int) -> str:
    """Where the broker holds the task's messages (ORM: row id and lock; Redis: list positions)."""
    from django.utils import timezone
    from django_q.signing import SignedPackage

    if BROKER == "redis":
        import redis

        listed = redis.Redis.from_url(os.environ["REDIS_URL"]).lrange("django_q:orchestrator:q", 0, -1)
        at = [i for i, raw in enumerate(listed) if (SignedPackage.loads(raw).get("args") or (None,))[0] == task_id]
        return f"at {at} of {len(listed)} in the list" if at else f"none of the {len(listed)} in the list"
    from django_q.models import OrmQ

    rows = [(pk, lock) for pk, lock, payload in OrmQ.objects.values_list("pk", "lock", "payload")
            if (SignedPackage.loads(payload).get("args") or (None,))[0] == task_id]
    now = timezone.now()
    ahead = {pk: OrmQ.objects.filter(pk__lt=pk, lock__lte=now).count() for pk, _ in rows}
    return ", ".join(f"row {pk} " + (f"locked until {lock:%H:%M:%S}" if lock > now else f"waiting, {ahead[pk]} before it")
                     for pk, lock in rows) or "no row"


def main():
    for task_id in Task.objects.exclude(status__in=TERMINAL).values_list("pk", flat=True):
        try:
            services.task_terminate(task_id=task_id, reason="bench: left over")
        except InvalidTransition:  # it finished meanwhile
            pass
    from django_q.brokers import get_broker

    get_broker().purge_queue()  # messages an earlier run left behind
    hosts = [spawn("qcluster") for _ in range(3)]
    sweeper = spawn("recover", "--loop", "--interval", "0.25")
    # Tasks long enough to be running when a host dies: 100 steps of 50 ms each (bench.listener;
    # no subprocess, so the host's process group is everything it ran).
    ids = [services.task_create(type="bench.listener", params={"steps": 100, "sleep_ms": 50}).pk
           for _ in range(TASKS)]
    recoveries: list[float] = []  # kill -> running again on another host
    released: list[float] = []  # kill -> the dead host's lease taken from it (recovered, queued again)
    waited: list[float] = []  # lease taken back -> running again: waiting for a free worker slot
    held_total = 0
    never: list[int] = []  # tasks a dead host held that did not run again within the 120 s watched
    # Tasks in some cluster's prefetch at the kill (the victim's among them): kill -> claimed, apart
    # for those that ran from a message sent again (lost with the dead host, or put back) and
    # those that ran from the message they had (a live host's prefetch).
    prefetch_claimed: list[float] = []
    resent_claimed: list[float] = []
    kept_claimed: list[float] = []
    prefetch_never: list[int] = []
    resent_never: list[int] = []
    try:
        for kill in range(KILLS):
            deadline = time.monotonic() + 60
            victim, held = None, {}
            while time.monotonic() < deadline and not held:
                victim = hosts[kill % len(hosts)]
                held = held_by(victim, hosts)
                time.sleep(0.05)
            if not held:
                print(f"  kill {kill + 1}: the host held no running task; skipped")
                continue
            taken = prefetched()
            killed_at = time.monotonic()
            held_total += len(held)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            others = [h for h in hosts if h is not victim]
            pending, holding = dict(held), dict(held)
            released_at: dict[int, float] = {}
            ran_again = 0
            while (pending or taken) and time.monotonic() - killed_at < 120:
                claimed = Task.objects.filter(pk__in=list(taken)).values_list("pk", "status", "lease_epoch",
                                                                               "enqueued_at")
                for task_id, status, epoch, enqueued_at in claimed:
                    epoch_then, enqueued_then = taken[task_id]
                    if status in TERMINAL or epoch > epoch_then:
                        prefetch_claimed.append(time.monotonic() - killed_at)
                        resent = enqueued_at is not None and (enqueued_then is None or enqueued_at > enqueued_then)
                        (resent_claimed if resent else kept_claimed).append(prefetch_claimed[-1])
                        del taken[task_id]
                for task_id, (epoch, owner) in list(pending.items()):
                    t = Task.objects.filter(pk=task_id).only("status", "lease_epoch", "worker_pid", "lease_owner").first()
                    if task_id in holding and (t.lease_owner != owner or t.lease_epoch > epoch):
                        released_at[task_id] = time.monotonic()
                        released.append(released_at[task_id] - killed_at)
                        del holding[task_id]
                    if t.status in TERMINAL or (t.lease_epoch > epoch and t.lease_owner and t.worker_pid
                                                and processes.alive(t.worker_pid)
                                                and host_of(t.worker_pid, others) is not None):
                        recoveries.append(time.monotonic() - killed_at)
                        if task_id in released_at:
                            waited.append(time.monotonic() - released_at[task_id])
                        ran_again += 1
                        del pending[task_id]
                time.sleep(0.02)
            never += list(pending)
            prefetch_never += list(taken)
            resent_never += [task_id for task_id, (_, enqueued_then) in taken.items()
                             if Task.objects.filter(pk=task_id, **({"enqueued_at__gt": enqueued_then} if enqueued_then
                                                                   else {"enqueued_at__isnull": False})).exists()]
            for task_id in pending:  # why: what the database says of each one still waiting
                t = Task.objects.get(pk=task_id)
                print(f"    task {task_id} not running again: status {t.status}, lease {t.lease_owner or '-'} "
                      f"epoch {t.lease_epoch}, enqueued {t.enqueued_at:%H:%M:%S.%f}, recovering since "
                      f"{t.recovering_since and f'{t.recovering_since:%H:%M:%S}'}")
            for task_id in taken:  # a prefetched one not claimed: the task, and its messages in the broker
                t = Task.objects.get(pk=task_id)
                print(f"    task {task_id} prefetched at the kill, not claimed within 120 s: status {t.status}, "
                      f"epoch {t.lease_epoch}, enqueued {t.enqueued_at:%H:%M:%S.%f} (killed at "
                      f"{time.strftime('%H:%M:%S', time.localtime(time.time() - (time.monotonic() - killed_at)))}); "
                      f"its messages: {messages_of(task_id)}")
            print(f"  kill {kill + 1}: host held {len(held)} running task(s); released after "
                  f"{', '.join(f'{v:.2f}' for v in released[-(len(held) - len(holding)):]) if len(held) > len(holding) else '-'} s; "
                  f"{ran_again} running again elsewhere within 120 s; {len(taken)} task(s) prefetched at the kill "
                  f"not claimed within 120 s")
            hosts = others + [spawn("qcluster")]  # the host comes back
        done = Task.objects.filter(pk__in=ids, status="completed").count()
        doubled = (TaskEvent.objects.filter(task_id__in=ids, kind="step_done")
                   .values("task_id", "payload__step").annotate(n=Count("id")).filter(n__gt=1).count())
        print(f"\nPostgreSQL, {'Redis' if BROKER == 'redis' else 'ORM'} broker, 3 hosts x 2 workers, {TASKS} tasks "
              f"queued or running, heartbeat 1 s, stale after {STALE} s, {KILLS} host kills")
        if released:
            print(f"  whole host kill -9 -> its tasks' leases taken back (recovered, queued): n {len(released)}, "
                  f"p50 {pct(released, 50):.2f} s, p95 {pct(released, 95):.2f} s")
        if recoveries:
            print(f"  whole host kill -9 -> each task it held running elsewhere: n {len(recoveries)}, "
                  f"p50 {pct(recoveries, 50):.2f} s, p95 {pct(recoveries, 95):.2f} s (target p95 <= 3 s)")
        if waited:
            print(f"    of which lease taken back -> running (waiting for a free slot on the other hosts): "
                  f"n {len(waited)}, p50 {pct(waited, 50):.2f} s, p95 {pct(waited, 95):.2f} s")
        late = sum(1 for seconds in recoveries if seconds > RUN_AGAIN_WITHIN) + len(never)
        print(f"  tasks that failed to run again within {RUN_AGAIN_WITHIN:g} s: {late} of {held_total} held by "
              f"killed hosts ({len(never)} not within 120 s{': ' + ', '.join(map(str, never)) if never else ''})")
        late = sum(1 for seconds in prefetch_claimed if seconds > RUN_AGAIN_WITHIN) + len(prefetch_never)
        if prefetch_claimed or prefetch_never:
            print(f"  tasks taken from the broker but not started at a kill (any host's prefetch; the killed host's "
                  f"are lost): n {len(prefetch_claimed) + len(prefetch_never)}, claimed p50 "
                  f"{pct(prefetch_claimed, 50) if prefetch_claimed else float('nan'):.2f} s, p95 "
                  f"{pct(prefetch_claimed, 95) if prefetch_claimed else float('nan'):.2f} s; "
                  f"not within {RUN_AGAIN_WITHIN:g} s: {late} ({len(prefetch_never)} not within 120 s)")
            for label, times, stuck in (
                    ("ran from a message sent again (the dead host's lost ones among them)", resent_claimed,
                     resent_never),
                    ("ran from the message they had (a live host's prefetch)", kept_claimed,
                     [t for t in prefetch_never if t not in resent_never])):
                late = sum(1 for seconds in times if seconds > RUN_AGAIN_WITHIN) + len(stuck)
                print(f"    {label}: n {len(times) + len(stuck)}, claimed p50 "
                      f"{pct(times, 50) if times else float('nan'):.2f} s, p95 "
                      f"{pct(times, 95) if times else float('nan'):.2f} s; not within {RUN_AGAIN_WITHIN:g} s: {late} "
                      f"({len(stuck)} not within 120 s)")
        print(f"  steps committed twice (fencing): {doubled}; tasks completed so far: {done}/{TASKS}")
    finally:
        # The hosts first: a task that finished meanwhile made the terminate below fail and
        # left every host running.
        for proc in [*hosts, sweeper]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for task_id in Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).values_list("pk", flat=True):
            try:
                services.task_terminate(task_id=task_id, reason="bench over")
            except InvalidTransition:
                pass


if __name__ == "__main__":
    main()

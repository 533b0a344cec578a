"""Run a program (`-m module ...` or `script.py ...`) with tracemalloc on, for bench/memory.py's
leak hunt (BENCH_TRACEMALLOC=1): on SIGUSR1 every process of it (forked children too: the
handler and the tracing are inherited) writes a snapshot to $BENCH_TRACEMALLOC_DIR/<pid>-<n>.snap.

    python bench/_traced.py -m daphne -b 127.0.0.1 -p 8000 orchestrator.asgi:application
    python bench/_traced.py manage.py qcluster
"""
import itertools
import os
import runpy
import signal
import sys
import threading
import tracemalloc

FRAMES = int(os.environ.get("BENCH_TRACEMALLOC_FRAMES", "12"))
OUT = os.environ["BENCH_TRACEMALLOC_DIR"]
_count = itertools.count(1)


def _dump() -> None:
    path = os.path.join(OUT, f"{os.getpid()}-{next(_count)}.snap")
    tracemalloc.take_snapshot().dump(path + ".tmp")
    os.replace(path + ".tmp", path)


def _on_signal(signum, frame) -> None:
    # Off the signal handler: a snapshot takes a while and must not run inside an allocation.
    threading.Thread(target=_dump, daemon=True).start()


def main() -> None:
    tracemalloc.start(FRAMES)
    signal.signal(signal.SIGUSR1, _on_signal)
    args = sys.argv[1:]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

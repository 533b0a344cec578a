"""Snapshots on the task page: the kept versions, each with what changed from the previous one."""
import json

from ..models import Snapshot

CHANGES_SHOWN = 12  # per version; the rest is counted


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "…"


def state_changes(old: dict, new: dict) -> list[str]:
    """What changed from one snapshot state to the next: params, limits, the task status,
    and each step's status ("batch-0003: pending → done"), in plan order."""
    changes = []
    for label, key in (("param", "params"), ("limit", "limits")):
        before, after = old.get(key) or {}, new.get(key) or {}
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                changes.append(f"{label} {name}: {_short(before.get(name))} → {_short(after.get(name))}")
    if old.get("status") and new.get("status") and old["status"] != new["status"]:
        changes.append(f"status: {old['status']} → {new['status']}")
    before, after = old.get("steps") or {}, new.get("steps") or {}
    gens_before, gens_after = old.get("generations") or {}, new.get("generations") or {}
    for step_id, status in after.items():
        if step_id not in before:
            changes.append(f"{step_id}: added ({status})")
            continue
        text = f"{step_id}: {before[step_id]} → {status}" if before[step_id] != status else ""
        generation = gens_after.get(step_id, 0)
        if generation != gens_before.get(step_id, 0):
            text = (text or f"{step_id}: {status}") + f" (re-run, generation {generation})"
        if text:
            changes.append(text)
    changes.extend(f"{step_id}: removed" for step_id in before if step_id not in after)
    return changes


def snapshot_history(kept: list[tuple[Snapshot, dict]]) -> list[dict]:
    """The kept snapshot versions (each with its full state), newest first, each with what
    changed from the previous kept version (the oldest kept one has nothing to compare with)."""
    ordered = sorted(kept, key=lambda pair: pair[0].version)
    rows, previous = [], None
    for snap, state in ordered:
        row = {"snapshot": snap, "version": snap.version, "step_id": snap.step_id, "created_at": snap.created_at,
               "previous": previous[0].version if previous else None, "changes": [], "more": 0, "note": ""}
        if previous is None:
            steps = state.get("steps") or {}
            row["note"] = (f"first version: a plan of {len(steps)} step{'s' if len(steps) != 1 else ''}"
                           if snap.version == 1 else "oldest kept version (earlier ones were pruned)")
        else:
            changes = state_changes(previous[1], state)
            row["changes"], row["more"] = changes[:CHANGES_SHOWN], max(0, len(changes) - CHANGES_SHOWN)
            if not changes:
                row["note"] = "no change"
        rows.append(row)
        previous = (snap, state)
    rows.reverse()
    return rows

"""How a run ends, decided from its state alone (engine/decision.py), and when a failed step is
retried (engine/outcomes.py retry_or_give_up): plain pytest, no database."""
import time
from types import SimpleNamespace

import pytest

from orchestrator.engine.plan_state import PlanState
from orchestrator.engine.decision import SLICED, decide
from orchestrator.engine.lease import Lease
from orchestrator.engine.outcomes import (RETRY_BACKOFF_MAX_SECONDS, GiveUp, Retry, failure_fingerprint,
                                          retry_or_give_up)
from orchestrator.engine.run_state import RunState

LIMITS = {"max_steps": 100, "max_tokens": 1_000_000, "max_seconds": 3600, "max_subtasks": 4}


def a_run(*, steps=("a", "b"), done=(), **fields) -> RunState:
    """A run of a plan of `steps` (those in `done` finished), with `fields` set on its state."""
    plan = PlanState()
    for step_id in steps:
        plan.add(step_id, ())
    for step_id in done:
        plan.set_status(step_id, "done")
    state = RunState(Lease(task_id=1, epoch=1, owner="worker", host="host", pid=1), plan=plan,
                     limits=dict(LIMITS))
    for name, value in fields.items():
        setattr(state, name, value)
    return state


def ambiguous(key: str):
    return SimpleNamespace(entry=SimpleNamespace(idempotency_key=key))


def test_all_steps_done_completes_and_reviews_what_was_left_in_doubt():
    outcome = decide(a_run(done=("a", "b")))
    assert (outcome.status, outcome.reason, outcome.review_cause) == ("completed", "all steps done", "all steps done")


def test_an_operator_ending_comes_first_even_with_every_step_done():
    for control, status in (("terminate", "terminated"), ("stop", "stopped")):
        outcome = decide(a_run(done=("a", "b"), control=control, ambiguous=[ambiguous("k")]))
        assert outcome.status == status
        assert outcome.review_cause == outcome.reason  # the ambiguous effects are reviewed with the ending


def test_a_stop_escalated_past_its_grace_terminates():
    outcome = decide(a_run(escalated=True, control="stop"))
    assert outcome.status == "terminated"
    assert outcome.reason.startswith("stop escalated to force-terminate")


def test_an_ambiguous_effect_awaits_review_before_a_failure_counts():
    outcome = decide(a_run(ambiguous=[ambiguous("k1"), ambiguous("k2")], failure="boom", needs_human="look"))
    assert (outcome.status, outcome.reason, outcome.open_reviews) == (
        "awaiting_review", "side effect in doubt: k1, k2", True)


def test_needs_human_before_failed():
    outcome = decide(a_run(needs_human="x" * 600, failure="boom"))
    assert (outcome.status, len(outcome.reason), outcome.error) == ("needs_human", 500, "x" * 600)
    assert not outcome.review_cause


def test_a_failure_fails_and_reviews_what_was_left_in_doubt():
    outcome = decide(a_run(failure="step a failed"))
    assert (outcome.status, outcome.reason, outcome.error, outcome.review_cause) == (
        "failed", "step a failed", "step a failed", "failed")


def test_a_pause_pauses():
    assert decide(a_run(control="pause")).reason == "paused by an operator"


def test_a_limit_pauses_with_its_name_and_the_step_s_detail():
    outcome = decide(a_run(limit_hit="max_tokens", limit_detail="the model asked for 900"))
    assert (outcome.status, outcome.reason, outcome.paused_by_limit) == (
        "paused", "limit: max_tokens (the model asked for 900)", "max_tokens")
    run = a_run(done=("a",), limits={**LIMITS, "max_steps": 1})
    assert (decide(run).reason, decide(run).paused_by_limit) == ("limit: max_steps", "max_steps")


def test_parked_steps_with_nothing_else_to_run_wait():
    run = a_run(done=("a",), parked={"b": {"step": "b", "type": "approval", "until": None}})
    run.plan.take_ready(10)  # b is not ready: it is parked
    assert decide(run).status == "waiting"


def test_a_parked_step_waits_not_while_another_step_is_ready_or_retrying():
    parked = {"a": {"step": "a", "type": "approval", "until": None}}
    assert decide(a_run(parked=parked)).status == SLICED  # b is ready
    run = a_run(done=("a",), parked=parked, not_before={"b": time.monotonic() + 5})
    run.plan.take_ready(10)
    assert decide(run).status == SLICED  # b retries soon


def test_a_slice_used_up_hands_the_task_on():
    assert decide(a_run(done=("a",))).status == SLICED


def test_retry_with_backoff_then_give_up():
    cause = ValueError("boom")
    assert retry_or_give_up("s", cause, attempts=1, repeated=False, winding_down=False, max_attempts=3) == Retry(0.5)
    assert retry_or_give_up("s", cause, attempts=2, repeated=False, winding_down=False, max_attempts=3) == Retry(1.0)
    verdict = retry_or_give_up("s", cause, attempts=3, repeated=False, winding_down=False, max_attempts=3)
    assert verdict == GiveUp("step s failed after 3 attempts: ValueError: boom")


def test_the_same_failure_twice_gives_up_at_once_unless_the_run_winds_down():
    cause = ValueError("boom")
    verdict = retry_or_give_up("s", cause, attempts=2, repeated=True, winding_down=False, max_attempts=10)
    assert isinstance(verdict, GiveUp) and "twice the same way" in verdict.why
    assert isinstance(retry_or_give_up("s", cause, attempts=2, repeated=True, winding_down=True, max_attempts=10),
                      Retry)


def test_the_backoff_is_capped():
    verdict = retry_or_give_up("s", ValueError(), attempts=30, repeated=False, winding_down=False, max_attempts=99)
    assert verdict == Retry(RETRY_BACKOFF_MAX_SECONDS)


@pytest.mark.parametrize("one, other", [("timeout after 3.2 s on 0x7f3a", "timeout after 9.9 s on 0x0001"),
                                         ("row 12 of deadbeefcafe", "row 7 of 0123456789ab")])
def test_a_fingerprint_ignores_the_volatile_parts_of_a_message(one, other):
    assert failure_fingerprint(RuntimeError(one)) == failure_fingerprint(RuntimeError(other))
    assert failure_fingerprint(RuntimeError(one)) != failure_fingerprint(ValueError(one))

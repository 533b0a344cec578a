"""Property-based tests of the API against its own OpenAPI schema (schemathesis): every
operation, with generated valid and invalid input, as an operator with a bearer token,
through the WSGI application. Every answer must be a declared status with a body matching
its declared schema, and never a 500.

Loaded with `schemathesis.openapi.from_wsgi` at module level (its pytest `from_fixture`
crashed under pytest 9.2). Examples are capped to keep the run short.
"""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings as hypothesis_settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from orchestrator.wsgi import application

schema = schemathesis.openapi.from_wsgi("/api/openapi.json", application)

MAX_EXAMPLES = 25


@pytest.fixture
def keep_test_connection():
    """Called straight as WSGI (not through Django's test client), the app would close the
    test's database connection at the end of each request, as it does in production."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def operator_headers(make_user, keep_test_connection):
    from orchestrator.auth import token_issue

    user = make_user("sam", "viewer", "operator", "reviewer")
    return {"Authorization": f"Bearer {token_issue(user=user)}"}


@pytest.fixture
def some_records(operator_headers):
    """A task and a review item, so that some generated ids (1, 2, …) hit real rows."""
    from orchestrator.engine import services
    from tests.review.conftest import make_review

    task = services.task_create(type="demo.pipeline", params={})
    make_review(task)
    return task


@pytest.mark.django_db
@schema.parametrize()
@hypothesis_settings(max_examples=MAX_EXAMPLES, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.filter_too_much])
def test_the_api_conforms_to_its_schema(case, operator_headers, some_records):
    # Not "every schema-valid request is accepted": a task's `params` are checked against
    # its type's own schema (GET /api/task-types) and a review decision needs a non-blank
    # note, by the services, which answer a declared 422 naming the field.
    case.call_and_validate(headers=operator_headers, excluded_checks=[positive_data_acceptance])

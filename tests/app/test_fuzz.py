"""Fuzz every operation of /openapi.json with schemathesis (bounded): no 500s, ever."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))


@pytest.fixture
def fuzz_app(settings, admin, make_group):
    from fastapi.testclient import TestClient

    from app.main import create_app

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=False)
    with TestClient(app) as c:  # some real rows, so ids 1 and 2 exist
        c.post("/api/datasets", files={"file": ("p.txt", b"one\ntwo\n", "text/plain")},
               headers=admin)
        c.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin)
        make_group(1, g=3)
    app.state.fuzz_headers = admin
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_api_never_500s(fuzz_app):
    schema = fuzz_app
    headers = schema.app.state.fuzz_headers
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18
    failures: list[str] = []
    statuses: dict[int, int] = {}

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            response = case.call(headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.query} "
                                f"{str(case.body)[:200]} -> {response.status_code}")

        run()
    print("status codes seen:", dict(sorted(statuses.items())))
    assert not failures, "\n".join(failures)
    assert statuses.get(200, 0) + statuses.get(201, 0) > 50  # it reached the real handlers

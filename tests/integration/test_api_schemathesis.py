"""Property-based fuzzing of the whole OpenAPI document (schemathesis): no input is a 500.

A real uvicorn on PostgreSQL (the backend that refuses NUL and out-of-range integers) serves the
app for the module; schemathesis generates requests for every operation, valid and invalid,
with an admin's key, and the one check is ``not_a_server_error``. The example count per
operation is bounded (``EXAMPLES``, or ``FTQ_SCHEMATHESIS_EXAMPLES`` for a longer soak) so
the module stays well under a minute on 2 cores. A stateful run follows the links
schemathesis infers (a created job's id into the routes that take one).

``GET /v1/jobs/{job_id}/events`` is left out: it is a stream that ends only with its job, so
a generated request for a queued job would wait forever; its bad inputs are covered in
``tests/integration/test_api_bad_input.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from sqlalchemy import text

from core.db import make_engine, make_sessionmaker
from core.settings import Settings
from tests.integration.conftest import TABLES
from tests.integration.helpers import LiveServer, make_user

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("FTQ_SCHEMATHESIS_EXAMPLES", "12"))
STREAMS = "/v1/jobs/{job_id}/events"


@pytest.fixture(scope="module")
def live_api(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("schemathesis")
    models = root / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    engine = make_engine(postgres_url)
    store = SimpleNamespace(sessions=make_sessionmaker(engine))
    key = make_user(store, "fuzz-admin", is_admin=True)
    app_settings = Settings(
        data_dir=root / "data",
        model_root=models,
        database_url=postgres_url,
        broker_url=f"sqla+sqlite:///{root / 'broker.db'}",
        max_upload_bytes=64 * 1024,
        auth_failure_limit=0,
        allow_hub_models=False,
    ).resolved()
    try:
        with LiveServer(app_settings) as server:
            yield SimpleNamespace(url=server.url, key=key, root=root, engine=engine)
    finally:
        with engine.begin() as conn:  # the module's rows must not meet the next test's store
            for table in TABLES:
                conn.execute(text(f'DELETE FROM "{table}"'))
        engine.dispose()


@pytest.fixture(scope="module")
def api_schema(live_api: SimpleNamespace) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{live_api.url}/openapi.json")
    schema.config.headers = {"Authorization": f"Bearer {live_api.key}"}
    return schema.exclude(path=STREAMS)


def test_no_operation_answers_a_server_error(api_schema: schemathesis.BaseSchema, live_api: SimpleNamespace) -> None:
    """Every operation, ``EXAMPLES`` generated requests each (schemathesis' pytest loader is not
    used: its lazy fixture schema does not run under pytest 9, so the operations are driven here)."""
    headers = {"Authorization": f"Bearer {live_api.key}"}
    failures: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=60)

        try:
            fuzz()
        except Exception as exc:  # collect every operation's failure, then fail once
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, "server errors:\n\n" + "\n\n".join(failures)


def test_linked_operations_answer_no_server_error(
    api_schema: schemathesis.BaseSchema, live_api: SimpleNamespace
) -> None:
    """Stateful: requests chained by the links schemathesis infers (ids from responses)."""
    machine = api_schema.as_state_machine()
    headers = {"Authorization": f"Bearer {live_api.key}"}

    class Machine(machine):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            """Each scenario starts from an empty store but for the admin and its key: answers
            depend on what is stored (an upload of bytes already stored returns that file), and
            hypothesis replays a scenario expecting the same answers."""
            with live_api.engine.begin() as conn:
                for table in TABLES:
                    if table not in ("user", "api_key"):
                        conn.execute(text(f'DELETE FROM "{table}"'))

        def get_call_kwargs(self, case: schemathesis.Case) -> dict:
            return {"headers": headers, "timeout": 60}  # the first tokenizing request starts a pool: slow on a busy CI box

        def validate_response(self, response, case, additional_checks=(), **kwargs) -> None:  # type: ignore[no-untyped-def]
            case.validate_response(response, checks=[not_a_server_error])

    Machine.run(settings=settings(max_examples=EXAMPLES, stateful_step_count=6, deadline=None,
                                  suppress_health_check=list(HealthCheck), derandomize=True, database=None))


"""Property-based fuzzing of both OpenAPI documents (schemathesis): no input is a 500.

A real uvicorn on PostgreSQL (the backend that refuses NUL and out-of-range integers) serves the
app for the module. schemathesis generates requests, valid and invalid, with an admin's key, for
every operation of the native API (``/openapi.json``) and of the OpenAI-compatible API (the
mounted sub-application's own document, ``/openai/v1/openapi.json``); the one check is
``not_a_server_error``. A stateful run per document follows the links schemathesis infers (a
created job's id into the routes that take one).

Cases: ``FTQ_SCHEMATHESIS_EXAMPLES`` per operation (12 by default, so the module stays under a
minute on 2 cores; the documented slow run in docs/security.md sets more). Every request sent
is counted (``SentCases``) and each test prints its count (``pytest -s``); the counts are what
docs/security.md reports, not an estimate.

The stateful run must see the same answers for the same requests: hypothesis replays a
scenario's choices and, when an answer's status differs (a response feeds a different bundle,
so other rules run), fails as ``FlakyStrategyDefinition`` ("Inconsistent data generation").
Each scenario therefore starts from the store exactly as it was when the module started: every
table is restored from a snapshot (``StoreSnapshot``), users, keys and projects included. The
earlier ``setup`` emptied the job tables only, and a traced run (100 examples) showed what leaked
from one scenario into the next: ``PATCH /v1/users/fuzz-admin {"max_running_jobs": 1}``, new
keys of the admin (``POST /v1/users/fuzz-admin/keys``: every later key listing longer), a
project ``0`` (``POST /v1/projects``: 201 once, 409 for any later scenario that sends it).

``GET /v1/jobs/{job_id}/events`` is left out: it is a stream that ends only with its job, so a
generated request for a queued job would wait forever; its bad inputs are covered in
``tests/integration/test_api_bad_input.py``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from sqlalchemy import Engine, MetaData, Table

from core.db import make_engine, make_sessionmaker
from core.settings import Settings
from tests.integration.helpers import LiveServer, make_user

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("FTQ_SCHEMATHESIS_EXAMPLES", "12"))
STEPS = 6
"""Requests per stateful scenario."""
STREAMS = "/v1/jobs/{job_id}/events"
DOCUMENTS = {"native": ("/openapi.json", ""), "openai": ("/openai/v1/openapi.json", "/openai/v1")}
"""Each API's document and the prefix its paths are served under."""
TIMEOUT_S = 60


class StoreSnapshot:
    """Every row of every table (but Alembic's) as it was, written back in one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        metadata = MetaData()
        metadata.reflect(engine)
        self.tables: list[Table] = [t for t in metadata.sorted_tables if t.name != "alembic_version"]
        with engine.connect() as conn:
            self.rows = {t.name: [dict(row._mapping) for row in conn.execute(t.select())] for t in self.tables}

    def restore(self) -> None:
        with self.engine.begin() as conn:
            for table in reversed(self.tables):
                conn.execute(table.delete())
            for table in self.tables:
                if self.rows[table.name]:
                    conn.execute(table.insert(), self.rows[table.name])


class SentCases(Counter[str]):
    """Requests sent, per document and kind of run."""

    def report(self, what: str) -> None:
        print(f"\nschemathesis {what}: {self[what]} cases sent (FTQ_SCHEMATHESIS_EXAMPLES={EXAMPLES}); "
              f"all so far: {sum(self.values())}")


@pytest.fixture(scope="module")
def live_api(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("schemathesis")
    models = root / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    engine = make_engine(postgres_url)
    store = SimpleNamespace(sessions=make_sessionmaker(engine))
    app_settings = Settings(
        data_dir=root / "data",
        model_root=models,
        database_url=postgres_url,
        broker_url=f"sqla+sqlite:///{root / 'broker.db'}",
        max_upload_bytes=64 * 1024,
        auth_failure_limit=0,
        allow_hub_models=False,
    ).resolved()
    empty = StoreSnapshot(engine)  # what the session's store held before this module
    key = make_user(store, "fuzz-admin", is_admin=True)
    try:
        with LiveServer(app_settings) as server:
            yield SimpleNamespace(url=server.url, key=key, snapshot=StoreSnapshot(engine))
    finally:
        empty.restore()  # the module's rows must not meet the next test's store
        engine.dispose()


@pytest.fixture(scope="module")
def sent() -> SentCases:
    return SentCases()


@pytest.fixture(scope="module", params=list(DOCUMENTS))
def api(request: pytest.FixtureRequest, live_api: SimpleNamespace) -> SimpleNamespace:
    """One document: ``name``, its ``schema`` (the paths its prefix serves), the ``headers`` to send."""
    document, prefix = DOCUMENTS[request.param]
    headers = {"Authorization": f"Bearer {live_api.key}"}
    # What the previous document's runs left (a generated scenario may delete the admin or revoke
    # its key, after which loading the next document was a 401) is undone first.
    live_api.snapshot.restore()
    schema = schemathesis.openapi.from_url(f"{live_api.url}{document}", headers=headers)
    schema.config.update(base_url=f"{live_api.url}{prefix}", headers=headers)
    return SimpleNamespace(name=request.param, schema=schema.exclude(path=STREAMS), headers=headers)


@pytest.fixture(autouse=True)
def _store_as_snapshotted(live_api: SimpleNamespace) -> None:
    """Each test starts from the module's snapshot, whatever the test before it generated."""
    live_api.snapshot.restore()


def test_no_operation_answers_a_server_error(api: SimpleNamespace, sent: SentCases) -> None:
    """Every operation, ``EXAMPLES`` generated requests each (schemathesis' pytest loader is not
    used: its lazy fixture schema does not run under pytest 9, so the operations are driven here)."""
    what = f"{api.name} operations"
    failures: list[str] = []
    operations = [result.ok() for result in api.schema.get_all_operations()]
    assert len(operations) >= (20 if api.name == "native" else 10)
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(case: schemathesis.Case) -> None:
            sent[what] += 1
            case.call_and_validate(headers=api.headers, checks=[not_a_server_error], timeout=TIMEOUT_S)

        try:
            fuzz()
        except Exception as exc:  # collect every operation's failure, then fail once
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    sent.report(what)
    assert not failures, "server errors:\n\n" + "\n\n".join(failures)
    assert sent[what] >= len(operations)


def test_linked_operations_answer_no_server_error(api: SimpleNamespace, live_api: SimpleNamespace,
                                                  sent: SentCases) -> None:
    """Stateful: requests chained by the links schemathesis infers (ids from responses), each
    scenario from the same store (the module docstring says why)."""
    what = f"{api.name} linked"
    machine = api.schema.as_state_machine()

    class Machine(machine):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            live_api.snapshot.restore()

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"headers": api.headers, "timeout": TIMEOUT_S}

        def validate_response(self, response, case, additional_checks=(), **kwargs) -> None:  # type: ignore[no-untyped-def]
            sent[what] += 1
            case.validate_response(response, checks=[not_a_server_error])

    Machine.run(settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                  suppress_health_check=list(HealthCheck), derandomize=True, database=None))
    sent.report(what)
    assert sent[what] >= EXAMPLES

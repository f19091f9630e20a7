"""``client.fine_tuning.alpha.graders.validate`` and ``.run`` with the official ``openai`` client
against ftq on a real uvicorn (one server for the module, its own SQLite store; the graders touch
no store beyond the key): string_check, text_similarity, python, multi; a python grader's
failure in the response's flags; a malformed grader, a missing template field and a model grader
refused with 400 naming the field; no key is 401."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from core.db import make_engine, make_sessionmaker
from core.migrate import upgrade
from core.settings import Settings
from tests.integration.helpers import make_user, serve

pytestmark = pytest.mark.integration

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "operation": "eq"}
ROUGE = {"type": "text_similarity", "name": "rouge", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "evaluation_metric": "rouge_l"}
PYTHON = {"type": "python", "name": "py",
          "source": "import json\n\ndef grade(sample, item):\n    print('grading')\n"
                    "    return 1.0 if sample['output_json']['city'] == item['answer'] else 0.0\n"}
MULTI = {"type": "multi", "name": "mix", "graders": {"exact": EXACT, "rouge": ROUGE},
         "calculate_output": "0.25 * exact + 0.75 * rouge"}
ITEM = {"answer": "Paris"}


@pytest.fixture(scope="module")
def oai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root: Path = tmp_path_factory.mktemp("graders")
    url = f"sqlite:///{root / 'ftq.db'}"
    upgrade(url)
    engine = make_engine(url)
    key = make_user(SimpleNamespace(sessions=make_sessionmaker(engine)), "admin", is_admin=True)
    settings = Settings(data_dir=root / "data", model_root=root / "models", database_url=url,
                        broker_url=f"sqla+sqlite:///{root / 'broker.db'}", redis_url=None,
                        grader_cpu_s=1, grader_wall_s=3.0, grader_memory_mib=256).resolved()
    with serve(settings) as server, openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key=key,
                                                  max_retries=0, timeout=30) as client:
        yield client
    engine.dispose()


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class TestValidate:
    @pytest.mark.parametrize("grader", [EXACT, ROUGE, PYTHON, MULTI], ids=lambda g: g["type"])
    def test_a_good_grader_comes_back(self, oai: openai.OpenAI, grader: dict) -> None:
        assert oai.fine_tuning.alpha.graders.validate(grader=grader).grader.to_dict() == grader

    def test_a_malformed_grader_is_400_naming_the_field(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.alpha.graders.validate(grader={**EXACT, "operation": "contains"})
        error = error_of(info.value)
        assert error["param"] == "grader.operation"
        assert error["message"] == "grader.operation: must be one of eq, ne, like, ilike (got 'contains')"

    def test_python_that_does_not_compile_is_400(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.alpha.graders.validate(grader={**PYTHON, "source": "def grade(:"})
        assert error_of(info.value)["param"] == "grader.source"

    def test_without_a_key_is_401(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.AuthenticationError):
            oai.with_options(api_key="ftq_nope_nope").fine_tuning.alpha.graders.validate(grader=EXACT)


class TestRun:
    def test_string_check(self, oai: openai.OpenAI) -> None:
        result = oai.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="Paris", item=ITEM)
        assert result.reward == 1.0
        assert result.metadata.name == "exact" and result.metadata.scores == {"exact": 1.0}
        assert not any(v for k, v in result.metadata.errors.to_dict().items() if isinstance(v, bool))

    def test_text_similarity(self, oai: openai.OpenAI) -> None:
        result = oai.fine_tuning.alpha.graders.run(grader=ROUGE, model_sample="It is Paris", item=ITEM)
        assert result.reward == pytest.approx(0.5)  # LCS 1 token: P 1/3, R 1/1, F 0.5

    def test_python(self, oai: openai.OpenAI) -> None:
        result = oai.fine_tuning.alpha.graders.run(grader=PYTHON, model_sample='{"city": "Paris"}', item=ITEM)
        assert result.reward == 1.0 and result.metadata.type == "python"
        assert result.metadata.execution_time > 0

    def test_python_reading_a_file_fails_the_item_with_its_message(self, oai: openai.OpenAI) -> None:
        nosy = {**PYTHON, "source": "def grade(sample, item):\n    return len(open('/etc/passwd').read())\n"}
        result = oai.fine_tuning.alpha.graders.run(grader=nosy, model_sample="x", item=ITEM)
        assert result.reward == 0.0 and result.metadata.errors.python_grader_runtime_error
        assert "open('/etc/passwd') is not allowed" in result.metadata.errors.python_grader_runtime_error_details

    def test_python_past_its_cpu_limit_is_a_server_error(self, oai: openai.OpenAI) -> None:
        loop = {**PYTHON, "source": "def grade(sample, item):\n    while True:\n        pass\n"}
        result = oai.fine_tuning.alpha.graders.run(grader=loop, model_sample="x", item=ITEM)
        assert result.metadata.errors.python_grader_server_error
        assert result.metadata.errors.python_grader_server_error_type in ("cpu", "wall")

    def test_multi(self, oai: openai.OpenAI) -> None:
        result = oai.fine_tuning.alpha.graders.run(grader=MULTI, model_sample="It is Paris", item=ITEM)
        assert result.reward == pytest.approx(0.375)
        assert result.sub_rewards == {"exact": 0.0, "rouge": pytest.approx(0.5)}

    def test_a_missing_template_field_is_400(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="Paris", item={"city": "Paris"})
        error = error_of(info.value)
        assert error["param"] == "grader.reference" and "item has no answer" in error["message"]

    def test_a_model_grader_is_400_saying_where_it_runs(self, oai: openai.OpenAI) -> None:
        label = {"type": "label_model", "name": "tone", "model": "tiny", "labels": ["ok", "bad"],
                 "passing_labels": ["ok"], "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
        assert oai.fine_tuning.alpha.graders.validate(grader=label).grader is not None
        with pytest.raises(openai.BadRequestError, match="need a judge model loaded on a GPU worker") as info:
            oai.fine_tuning.alpha.graders.run(grader=label, model_sample="hi", item={})
        assert error_of(info.value)["param"] == "grader.type"

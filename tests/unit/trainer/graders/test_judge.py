"""score_model and label_model: the judge's messages, its answer read as OpenAI's structured result,
and the trainer's sampler as the judge (a tiny random-weight Llama on CPU)."""

from __future__ import annotations

import pytest

from trainer.graders import grade, validate
from trainer.graders.errors import GraderError
from trainer.graders.judge import JudgeAnswerError, JudgeParams, engine_judge, judge_messages, read_answer
from trainer.graders.template import sample_namespace

SCORE = validate({"type": "score_model", "name": "judge", "model": "tiny", "range": [0, 10],
                  "sampling_params": {"max_completions_tokens": 8, "seed": 3},
                  "input": [{"role": "developer", "content": "Is this {{item.lang}}?"},
                            {"role": "user", "content": "{{sample.output_text}}"}]})
LABEL = validate({"type": "label_model", "name": "tone", "model": "tiny", "labels": ["polite", "rude"],
                  "passing_labels": ["polite"], "input": [{"role": "user", "content": "{{sample.output_text}}"}]})
ITEM = {"lang": "French"}


class TestMessages:
    def test_rendered_with_the_answer_contract_first(self) -> None:
        spaces = {"item": ITEM, "sample": sample_namespace("Bonjour")}
        messages = judge_messages(SCORE, spaces, "grader")
        assert messages[0] == {"role": "system", "content": 'Answer with a JSON object {"result": <score>} where '
                                                             "<score> is a number from 0 to 10, and nothing else."}
        assert messages[1:] == [{"role": "system", "content": "Is this French?"}, {"role": "user", "content": "Bonjour"}]

    def test_a_missing_field_raises_naming_the_message(self) -> None:
        with pytest.raises(GraderError) as info:
            judge_messages(SCORE, {"item": {}, "sample": sample_namespace("x")}, "grader")
        assert info.value.param == "grader.input[0].content"


class TestAnswers:
    @pytest.mark.parametrize(("answer", "expected"), [
        ('{"result": 7}', 7.0), ('Sure. {"steps": [], "result": 2.5} done', 2.5), ("10", 10.0), (' "3" ', 3.0),
    ])
    def test_a_score(self, answer: str, expected: float) -> None:
        assert read_answer(SCORE, answer) == (expected, expected)

    @pytest.mark.parametrize(("answer", "says"), [("eleven", "not a score"), ('{"result": 11}', "outside range"),
                                                  ('{"score": 3}', "not a score")])
    def test_an_unreadable_score(self, answer: str, says: str) -> None:
        with pytest.raises(JudgeAnswerError, match=says):
            read_answer(SCORE, answer)

    def test_labels_pass_or_fail(self) -> None:
        assert read_answer(LABEL, '{"result": "polite"}') == (1.0, "polite")
        assert read_answer(LABEL, "rude") == (0.0, "rude")
        with pytest.raises(JudgeAnswerError, match="not one of the labels"):
            read_answer(LABEL, "neutral")

    def test_grade_with_a_judge_and_a_parse_error_fails_only_the_item(self) -> None:
        seen = []

        def judge(messages, params):
            seen.append(params)
            return '{"result": 8}' if "good" in messages[-1]["content"] else "no idea"

        assert grade(SCORE, "good", ITEM, judge=judge).score == 8.0
        assert seen[0] == JudgeParams(max_tokens=8, temperature=0.0, top_p=1.0, seed=3)
        failed = grade(SCORE, "bad", ITEM, judge=judge)
        assert failed.score == 0.0 and failed.errors["model_grader_parse_error"]
        assert "not a score: 'no idea'" in failed.error

    def test_no_judge_is_an_error_naming_the_type(self) -> None:
        with pytest.raises(GraderError, match="needs a judge model") as info:
            grade(LABEL, "hi", {})
        assert info.value.param == "grader.type"


class TestEngineJudge:
    def test_the_sampler_answers_through_the_chat_template(self) -> None:
        from trainer.generate.chat import render_messages
        from trainer.generate.engine import Engine
        from trainer.generate.params import Request, SamplingParams
        from trainer.model.tiny import build_tiny_model

        model, tokenizer = build_tiny_model("llama", seed=0)
        engine = Engine(model, tokenizer, slots=2, max_len=512)
        judge = engine_judge(engine, tokenizer)
        messages = judge_messages(SCORE, {"item": ITEM, "sample": sample_namespace("Bonjour")}, "grader")
        answer = judge(messages, JudgeParams(max_tokens=8))
        [direct] = engine.generate([Request(tuple(render_messages(tokenizer, messages)), SamplingParams(
            max_tokens=8, temperature=0.0))])
        assert answer == direct.completions[0].text
        # A random-weight model does not answer with a score: the item fails with what it said.
        result = grade(SCORE, "Bonjour", ITEM, judge=judge)
        assert result.errors["model_grader_parse_error"] and result.log == answer

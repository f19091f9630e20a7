"""bench.grpo's pieces on the CPU: the prompts, the ftq job and the verdict (the run itself is the GPU's)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import grpo, product_path


class TestGrpoBench:
    @pytest.mark.slow  # a tiny model saved and its vocabulary scanned: ~8 s
    def test_prompts_are_exactly_the_workloads_length_for_both_runs(self, tmp_path) -> None:
        from transformers import AutoTokenizer

        model_dir = product_path.save_model(product_path.TINY, tmp_path / "model", "cpu")
        prompts = grpo.write_prompts(tmp_path / "prompts.jsonl", model_dir, grpo.SMALL, 5)
        assert [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()] == prompts
        tokenizer = AutoTokenizer.from_pretrained(model_dir)  # TRL and ftq both tokenize a text prompt so
        assert {len(tokenizer(p)["input_ids"]) for p in prompts} == {grpo.SMALL.prompt_tokens}

    def test_the_ftq_job_takes_the_steps_prompts_in_micro_batches_of_four_groups(self, tmp_path) -> None:
        job = grpo.ftq_job(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", 3, "cuda", grpo.FULL)
        assert job["objective"] == "grpo" and job["grpo"]["graders"] == grpo.GRADER
        assert job["data"]["batch_tokens"] == 4 * 8 * (256 + 512)
        assert job["optim"]["grad_accum"] * 4 == grpo.FULL.prompts_per_step

    def test_the_reward_function_is_the_graders_twin(self) -> None:
        from trainer.graders.run import grade
        from trainer.graders.spec import validate

        grader = validate(grpo.GRADER, "grpo.graders")
        texts = ["", "HELLO", "xyz", " the end", "E"]
        assert grpo.has_e(texts) == [grade(grader, t, {}, param="grpo.graders").score for t in texts]

    def test_the_verdict_names_a_missed_target(self) -> None:
        def row(step_s: float, peak: float) -> grpo.Row:
            return grpo.Row("r", step_ms=[step_s * 1e3], generation_ms=[step_s * 500], reward_ms=[1.0],
                            generated=[100], trained=[200], peak_gib=[peak], reward_mean=[0.5])

        args = argparse.Namespace(skip=0, trl_skip=0, tiny=False)
        assert "2.00x faster (target >= 3x: MISSED)" in grpo.verdict(row(50, 30), row(100, 40), args)
        assert "(target >= 3x: met)" in grpo.verdict(row(30, 30), row(100, 40), args)
        assert "(no more)" in grpo.verdict(row(30, 30), row(100, 40), args)

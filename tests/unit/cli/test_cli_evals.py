"""``ftq eval``: the flags become the run's body; a run and an item read as lines."""

from __future__ import annotations

import pytest

from cli.errors import CliError
from cli.evals import format_item, format_run, run_body, template_of
from cli.main import build_parser


class TestEvalCommand:
    def test_run_flags_become_the_runs_data_source(self) -> None:
        args = build_parser().parse_args(["eval", "run", "eval_1", "ft:tiny:me::job-1", "items.jsonl",
                                          "--template", "system:Be brief.", "--template", "user:{{item.q}}",
                                          "--max-tokens", "8", "--temperature", "0", "--name", "tuned"])
        assert run_body(args, "file-1") == {"name": "tuned", "data_source": {
            "type": "completions", "model": "ft:tiny:me::job-1", "source": {"type": "file_id", "id": "file-1"},
            "input_messages": {"type": "template", "template": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "{{item.q}}"}]},
            "sampling_params": {"max_completion_tokens": 8, "temperature": 0.0}}}

    def test_a_template_without_a_known_role_is_refused(self) -> None:
        with pytest.raises(CliError, match="ROLE:TEXT"):
            template_of(["{{item.q}}"])

    def test_a_run_and_an_item_print_their_counts_and_scores(self) -> None:
        run = {"id": "evalrun_1", "status": "completed", "model": "tiny", "result_counts": {
            "total": 3, "passed": 2, "failed": 1, "errored": 0}, "per_testing_criteria_results": [
            {"testing_criteria": "exact", "passed": 2, "failed": 1, "mean_score": 2 / 3}]}
        assert format_run(run) == ("evalrun_1  completed  tiny  passed 2/3 (failed 1, errored 0)\n"
                                   "    exact: 2 passed, 1 failed, mean score 0.667")
        item = {"datasource_item_id": 1, "status": "fail", "sample": {"output": [{"content": "no"}]},
                "results": [{"name": "exact", "score": 0.0, "passed": False}]}
        assert format_item(item) == '  #1  fail  "no"  exact 0 ✗'


class TestLmEvalTask:
    """``ftq eval lm-eval``: the task YAML read locally, its documents found, a hub dataset refused."""

    def test_the_yaml_s_local_documents_are_found_and_its_dataset_keys_left_out(self, tmp_path, monkeypatch) -> None:
        from cli.evals_lm import load_task

        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "qa.jsonl").write_text('{"q": "x"}\n')
        (tmp_path / "task.yaml").write_text("task: qa\noutput_type: generate_until\ndataset_path: json\n"
                                            "dataset_kwargs:\n  data_files:\n    test: docs/qa.jsonl\n"
                                            "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: x\n")
        monkeypatch.chdir(tmp_path / "docs")
        task, data = load_task(tmp_path / "task.yaml")
        assert task == {"task": "qa", "output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "x"}
        assert data == tmp_path / "docs" / "qa.jsonl"
        args = build_parser().parse_args(["eval", "lm-eval", "eval_1", "tiny", str(tmp_path / "task.yaml"), "--no-wait"])
        assert (args.eval_id, args.model, args.task, args.no_wait) == ("eval_1", "tiny", tmp_path / "task.yaml", True)

    @pytest.mark.parametrize(("text", "message"), [
        ("task: h\ndataset_path: Rowan/hellaswag\n", "local documents only"),
        ("task: h\nprocess_docs: !function utils.process\n", "!function"),
        ("task: h\ndataset_path: json\ndataset_kwargs:\n  data_files: missing.jsonl\n", "is not a file"),
    ])
    def test_a_task_that_would_download_or_run_code_is_refused(self, tmp_path, text, message) -> None:
        from cli.evals_lm import load_task

        (tmp_path / "task.yaml").write_text(text)
        with pytest.raises(CliError, match=message):
            load_task(tmp_path / "task.yaml")

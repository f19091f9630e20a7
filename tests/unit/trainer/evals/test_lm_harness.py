"""lm-eval-harness through ftq (``trainer.evals.lm_harness``), when the optional ``lm-eval`` package
is installed: ``FtqLM`` against lm-eval's own ``HFLM`` on the same tiny Llama (its loglikelihoods
and greedy generations are the reference), and the local tasks of tests/data/lm_eval run offline
end to end (``evaluate``: generate_until through the sampler, multiple_choice through forwards)."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the optional lm-eval extra is not installed")

REPO_ROOT = Path(__file__).resolve().parents[4]
TASKS = REPO_ROOT / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihoods_and_greedy_generations_match_lm_evals_hflm(loaded) -> None:
    from lm_eval.models.huggingface import HFLM

    from trainer.evals.lm_harness import FtqLM

    model, tokenizer = loaded
    ours, reference = FtqLM(model, tokenizer, batch_size=2), HFLM(pretrained=model, tokenizer=tokenizer, device="cpu",
                                                                   batch_size=2)
    pairs = [("Q: What does the cat sit on?\nA:", " a mat"), ("Q: Where did the dog run?\nA:", " in the park"),
             ("the old stone", " bridge near the sky")]
    got = ours.loglikelihood(_instances("loglikelihood", pairs))
    want = reference.loglikelihood(_instances("loglikelihood", pairs))
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-4, abs=1e-3)
    assert [g[1] for g in got] == [w[1] for w in want]
    prompts = [("Q: What color is the sky?\nA:", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
               ("the cat sat on", {"until": ["."], "max_gen_toks": 6, "do_sample": False})]
    assert ours.generate_until(_instances("generate_until", prompts)) == \
        reference.generate_until(_instances("generate_until", prompts))


def test_local_tasks_run_offline_end_to_end(loaded, monkeypatch) -> None:
    from trainer.evals.lm_harness import evaluate

    monkeypatch.chdir(REPO_ROOT)  # the task YAMLs name their JSONL from the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = evaluate(*loaded, TASKS, ["ftq_tiny_generate", "ftq_tiny_choice"])
    assert got["results"]["ftq_tiny_generate"]["sample_len"] == 4
    assert 0.0 <= got["results"]["ftq_tiny_generate"]["exact_match,none"] <= 1.0
    assert got["results"]["ftq_tiny_choice"]["acc,none"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    [first, *_] = got["samples"]["ftq_tiny_choice"]
    scores = [resp[0][0] for resp in first["resps"]]
    assert first["acc"] == float(max(range(3), key=scores.__getitem__) == first["doc"]["label"])


def _task(name: str) -> dict:
    """A task YAML of tests/data/lm_eval as an lm_eval run's ``data_source.task``: minus its dataset keys
    (the run's items are its documents), checked as the API checks it."""
    import yaml

    from core.evals.lm_task import check_task

    raw = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
    return check_task({k: v for k, v in raw.items() if not k.startswith("dataset_") and not k.endswith("_split")})


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["ftq_tiny_generate", "ftq_tiny_choice"])
def test_an_lm_eval_run_scores_each_item_once_in_chunks_and_resumes(name, tmp_path, tiny_model_dir, loaded,
                                                                    monkeypatch) -> None:
    """``python -m trainer eval`` with ``lm_eval``: the run's lines carry lm-eval's own per-document scores
    (the same as one ``evaluate`` of the whole task), a cancelled run keeps its finished chunks and a
    resumed one scores only the rest."""
    import json
    import os
    import signal

    from trainer.evals import lm_run
    from trainer.evals.config import EvalConfig
    from trainer.evals.lm_harness import evaluate
    from trainer.evals.run import run_eval
    from trainer.generate import outputs
    from trainer.parallel.distributed import World

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the run sets them: restored after the test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task, criteria = _task(name)
    docs = [json.loads(line) for line in (TASKS / "tiny_qa.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": json.dumps(d), "item": d}) + "\n" for d in docs))
    config = EvalConfig(model=str(tiny_model_dir), prompts_file=str(prompts), output_dir=str(tmp_path / "out"),
                        sampling={"max_tokens": 8, "temperature": 0.0}, chunk_prompts=3, testing_criteria=criteria,
                        lm_eval=task)
    scored, real = [], lm_run.run_chunk
    monkeypatch.setattr(lm_run, "run_chunk", lambda lm, t, chunk, where: scored.append(len(chunk)) or real(lm, t, chunk, where))

    def stop_after_first_chunk(type_: str, **payload) -> None:
        if type_ == "progress" and payload["tokens_per_s"] is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    assert run_eval(config, stop_after_first_chunk, World()) == "cancelled"
    assert sorted(outputs.read_lines(config.completions_path, config.parts_dir)) == [0, 1, 2]
    assert run_eval(config, lambda *a, **k: None, World()) == "succeeded"
    assert scored == [3, 1], "the resumed run scores only the item with no line"
    lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
    monkeypatch.chdir(REPO_ROOT)
    whole = {s["doc_id"]: s for s in evaluate(*loaded, TASKS, [name])["samples"][name]}
    metric = criteria[0]["name"]
    for line in lines:
        want = float(whole[line["index"]][metric])
        assert line["item"] == docs[line["index"]]
        assert [(r["name"], r["score"], r["passed"]) for r in line["results"]] == [(metric, want, want >= 1.0)]
        assert line["status"] == ("pass" if want >= 1.0 else "fail")
        assert line["messages"][0]["content"] == f"Q: {docs[line['index']]['question']}\nA:"
    if name == "ftq_tiny_choice":  # the answer shown is the likeliest choice
        for line in lines:
            likeliest = max(range(3), key=lambda i: line["lm_eval"]["responses"][i][0])
            assert line["choices"][0]["text"] == " " + docs[line["index"]]["choices"][likeliest]


ESCAPES = {
    # each passes the submission's checks (no "__" in the task's text): the name is spelled at render time
    "escaped": "{{ lipsum['\\x5f\\x5fglobals\\x5f\\x5f']['os'].popen('touch {marker}').read() }}Q: {{question}}",
    "joined": "{{ (lipsum|attr('_'*2 ~ 'globals' ~ '_'*2)).os.popen('touch {marker}').read() }}Q: {{question}}",
    "via a string": "{{ (''|attr('_'*2 ~ 'class' ~ '_'*2)) }}{{ question }}",
    "via the doc": "{{ (question|attr('_'*2 ~ 'class' ~ '_'*2)|attr('_'*2 ~ 'mro' ~ '_'*2)) }}",
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_a_task_template_cannot_reach_python_internals(name, tmp_path) -> None:
    """lm-eval renders templates with a plain jinja2 Environment; ftq swaps in Jinja's sandbox
    (``lm_run.sandbox_templates``, which also drops the ``lipsum``/``cycler``/``joiner`` globals): a
    template that builds a dunder at render time fails the chunk (the sandbox's SecurityError, or an
    undefined name: its unsafe attribute reads as undefined) and runs nothing (a command it tried to
    run would have touched ``marker``)."""
    from jinja2.exceptions import TemplateError
    from lm_eval.models.dummy import DummyLM

    from core.evals.lm_task import check_task
    from trainer.evals import lm_run

    marker = tmp_path / "ran"
    task = {"task": "escape", "output_type": "generate_until", "doc_to_target": "{{answer}}",
            "doc_to_text": ESCAPES[name].replace("{marker}", str(marker))}
    config, _ = check_task(task)  # the submission's check is not the boundary: the sandbox is
    with pytest.raises(TemplateError):
        lm_run.run_chunk(DummyLM(), config, [{"question": "2+2", "answer": "4"}], tmp_path / "chunk")
    assert not marker.exists()


def test_an_ordinary_template_with_regex_replace_still_renders(tmp_path) -> None:
    from lm_eval.models.dummy import DummyLM

    from core.evals.lm_task import check_task
    from trainer.evals import lm_run

    task = {"task": "plain", "output_type": "generate_until", "doc_to_target": "{{answer}}",
            "doc_to_text": "Q: {{ question | regex_replace('[+]', ' plus ') }}\nA:"}
    config, _ = check_task(task)
    (sample,) = lm_run.run_chunk(DummyLM(), config, [{"question": "2+2", "answer": "4"}], tmp_path / "chunk").values()
    assert sample["arguments"][0][0] == "Q: 2 plus 2\nA:"

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

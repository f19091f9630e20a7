"""A GRPO job's checks before it is queued: its grader, its completion length, its prompts.

``check_grader`` (from ``core.jobs.admission``, every entry) refuses a missing or malformed grader
and a model grader: ``score_model`` / ``label_model`` need a judge model beside the policy, which a
GRPO job does not load; ``check_no_validation`` a validation file, which the trainer would not
read. ``report`` (the preflight, ``api.jobs.preview``) reads the prompts file
as the trainer will (``trainer.generate.prompts``), refuses a ``max_new_tokens`` the model's
context cannot hold (where the API knows it: a local model's config.json; otherwise the trainer
refuses at its start) or a group that cannot fit one micro-batch, and grades a placeholder
completion against the first ``DRY_RUN_RECORDS`` records, so a template naming a field the
records lack (``{{item.answer}}``) or a python grader whose code the sandbox refuses is a 422 now
instead of a failed job. Any other failure on the placeholder (a python grader that raises, a
limit, a formula's division) is only a warning: it may rightly fail on an empty completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.errors import InvalidInput

if TYPE_CHECKING:
    from trainer.graders import SandboxLimits

PARAM = "grpo.graders"
DRY_RUN_RECORDS = 3
"""Records graded at submission (each a python grader's sandbox process, ~50 ms)."""
PLACEHOLDER = ""
"""The completion graded at submission: the empty one a model may well write."""


def check_grader(grader: dict[str, Any] | None) -> dict[str, Any]:
    """The job's grader validated (defaults filled in).

    Raises:
        InvalidInput: no grader, a malformed one (naming its field), or a model grader.
    """
    from trainer.graders import GraderError, uses_model, validate  # the API's, not the worker's (admission)

    if grader is None:
        raise InvalidInput(f"{PARAM}: a GRPO job needs a grader (the reward), e.g. "
                           '{"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", '
                           '"reference": "{{item.answer}}", "operation": "eq"}', param=PARAM)
    try:
        checked = validate(grader, PARAM)
    except GraderError as exc:
        raise InvalidInput(exc.message, param=exc.param) from None
    if uses_model(checked):
        raise InvalidInput(f"{PARAM}.type: score_model and label_model graders need a judge model loaded beside the "
                           "policy, which a GRPO job does not run; use string_check, text_similarity, python or a "
                           "multi grader of those", param=f"{PARAM}.type")
    return checked


def check_no_validation(validation_file: str | None) -> None:
    """A GRPO job has no validation loss to compute (its reward is its steps' ``reward_mean``)."""
    if validation_file is not None:
        raise InvalidInput("validation_file: a GRPO job does not evaluate a validation file (its rewards are in each "
                           "step's reward_mean); remove validation_file", param="validation_file")


def check_context(max_new_tokens: int, context: int | None) -> None:
    """Refuse completions as long as the model's context (``max_position_embeddings``) or longer."""
    if context is not None and max_new_tokens >= context:
        raise InvalidInput(f"grpo.max_new_tokens: {max_new_tokens} new tokens do not fit the model's context of "
                           f"{context} tokens with a prompt before them; lower it below {context}",
                           param="grpo.max_new_tokens")


def check_group_fits(group_size: int, max_new_tokens: int, batch_tokens: int) -> None:
    """A prompt's group is packed whole into one micro-batch (``trainer.objectives.grpo``): refuse a
    group of longest completions that cannot fit ``batch_tokens`` even after a one-token prompt."""
    if group_size * (max_new_tokens + 1) > batch_tokens:
        raise InvalidInput(f"hyperparameters.batch_tokens: a prompt's {group_size} completions of up to "
                           f"{max_new_tokens} tokens are packed into one micro-batch with the prompt, more than "
                           f"batch_tokens={batch_tokens}; raise it to at least group_size x (prompt + max_new_tokens) "
                           "tokens, or lower grpo.group_size or grpo.max_new_tokens",
                           param="hyperparameters.batch_tokens")


def report(grpo: dict[str, Any], path: str, fmt: str, context: int | None, limits: SandboxLimits,
           batch_tokens: int) -> dict[str, Any]:
    """The preflight report of a GRPO job (``api.jobs.schemas.PreflightOut``'s shape). Blocking.

    Raises:
        InvalidInput: see the module docstring, naming ``training_file`` or the ``grpo`` field.
    """
    from trainer.generate.prompts import CHAT, PromptError, read_prompts

    checked = check_grader(grpo.get("graders"))
    check_context(grpo["max_new_tokens"], context)
    check_group_fits(grpo["group_size"], grpo["max_new_tokens"], batch_tokens)
    if fmt != "prompts":  # admission refuses it, naming the formats grpo trains on
        return {"checked": False, "note": f"a {fmt} file is not a prompts file", "warnings": []}
    try:
        prompts = read_prompts(path)
    except PromptError as exc:
        raise InvalidInput(f"training_file: {exc}", param="training_file") from None
    warnings = [w for prompt in prompts[:DRY_RUN_RECORDS] if (w := _dry_run(checked, prompt, limits))]
    chat = sum(p.fmt == CHAT for p in prompts)
    note = (f"{len(prompts)} prompts ({chat} chat, {len(prompts) - chat} text); the grader ran on the first "
            f"{min(len(prompts), DRY_RUN_RECORDS)} with an empty completion")
    return {"checked": True, "format": "prompts", "records": len(prompts), "note": note, "warnings": warnings}


def _dry_run(grader: dict[str, Any], prompt: Any, limits: SandboxLimits) -> str | None:
    """A warning, or None; raises InvalidInput where the grader cannot grade this record at all."""
    from trainer.graders import GraderError, grade

    try:
        result = grade(grader, PLACEHOLDER, prompt.record, limits=limits, param=PARAM)
    except GraderError as exc:
        raise InvalidInput(f"{exc.message} (training_file line {prompt.line})", param=exc.param) from None
    if result.ok:
        return None
    if result.error_type == "refused":  # the sandbox refused what the code does, whatever the completion
        raise InvalidInput(f"{PARAM}: fails on training_file line {prompt.line}: {result.error}", param=PARAM)
    return f"grpo.graders: on training_file line {prompt.line} with an empty completion: {result.error}"

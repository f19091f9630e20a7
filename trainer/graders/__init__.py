"""Graders in OpenAI's shapes, defined once for the service, evals and training.

``validate(grader) -> dict`` checks a grader as OpenAI's JSON (``string_check``,
``text_similarity``, ``python``, ``score_model``, ``label_model``, ``multi``) and raises
``GraderError`` naming the field; ``grade(grader, output_text, item)`` scores one output.
Standard library only: the API imports this package, and torch is imported only by
``judge.engine_judge`` (the sampler behind ``score_model`` and ``label_model``) when it is called.
See docs/graders.md.
"""

from trainer.graders.errors import GraderError
from trainer.graders.run import ERROR_FLAGS, GradeResult, grade, model_graders, uses_model
from trainer.graders.sandbox import SandboxLimits
from trainer.graders.spec import validate

__all__ = ["ERROR_FLAGS", "GradeResult", "GraderError", "SandboxLimits", "grade", "model_graders", "uses_model",
           "validate"]

"""Every store model, imported in one place so Alembic sees the whole metadata."""

from core.db import Base
from core.evals.models import Eval, EvalRun
from core.exports.models import Export
from core.files.models import File
from core.jobs.models import Checkpoint, Job, JobEvent, JobNode, StepMetric
from core.openai.models import OpenAIJob
from core.projects.models import Project, ProjectMember
from core.sessions.models import SessionMessage
from core.users.models import ApiKey, User
from core.workers.models import GpuSlot, Worker, WorkerKey

metadata = Base.metadata

__all__ = ["ApiKey", "Base", "Checkpoint", "Eval", "EvalRun", "Export", "File", "GpuSlot", "Job", "JobEvent", "JobNode", "OpenAIJob", "Project", "ProjectMember", "SessionMessage", "StepMetric", "User", "Worker", "WorkerKey", "metadata"]

"""Service settings from the environment (``FTQ_*``), built once at start-up and passed along.

With no URLs set, everything is embedded under ``FTQ_DATA_DIR``: a SQLite store
(``ftq.db``) and a broker that needs no server (kombu's SQLAlchemy transport on
``broker.db``). Production sets ``FTQ_DATABASE_URL`` (PostgreSQL), ``FTQ_BROKER_URL`` and
``FTQ_REDIS_URL`` (Redis).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer.catalog import SERVER_TRACKERS

TRACKING_SERVER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
TRACKING_SERVER_URL = re.compile(r"^https?://[^\s@/]+(/\S*)?$")
LEGACY_MLFLOW_SERVER = "mlflow"
"""The name jobs use for the server of ``FTQ_MLFLOW_TRACKING_URI`` (core.jobs.trackers.allowed_trackers)."""


class TrackingServer(BaseModel):
    """One experiment-tracking server the operator lets jobs name (``FTQ_TRACKING_SERVERS``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal[SERVER_TRACKERS]  # type: ignore[valid-type]
    url: str | None = Field(default=None, max_length=2048, pattern=TRACKING_SERVER_URL.pattern)
    """http(s)://host[:port][/path], no user:password in it; required for MLflow. W&B without
    one: W&B's cloud, or the worker's ``WANDB_BASE_URL``."""
    credential_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The worker's environment variable whose value is sent to this server alone (MLflow:
    ``Authorization: Bearer``; W&B: the API key). Unset: this server gets no credential."""
    default: bool = False
    """The server of its kind a job that names none gets (a default MLflow server tracks every
    job that does not set ``tracking.mlflow`` false)."""

    @model_validator(mode="after")
    def _check_url(self) -> "TrackingServer":
        if self.kind == "mlflow" and not self.url:
            raise ValueError("url: an MLflow server needs its URL (http(s)://host:port)")
        if self.url is not None:
            object.__setattr__(self, "url", self.url.rstrip("/"))
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FTQ_", extra="ignore")

    data_dir: Path = Field(default=Path("~/.local/share/ftq"))
    """Datasets (``files/``), job outputs (``jobs/<id>/``) and the embedded store and broker."""
    model_root: Path = Field(default=Path("~/.local/share/ftq/models"))
    """Local models users may name by a path under this directory."""
    database_url: str | None = None
    """SQLAlchemy URL of the job store; default ``sqlite:///<data_dir>/ftq.db``."""
    broker_url: str | None = None
    """Celery broker URL; default ``sqla+sqlite:///<data_dir>/broker.db``."""
    redis_url: str | None = None
    """Redis for live event pub/sub; unset means viewers poll the store."""
    api_url: str | None = None
    """The API's base URL (``http://mainbox:8000``) a remote worker fetches datasets from and
    uploads checkpoints, adapters and exports to; required with ``worker_key``."""
    worker_key: SecretStr | None = None
    """A worker key (``ftqw_...``, ``ftq workers key create NAME``): set, the worker is *remote*:
    it shares no disk with the API and moves bytes through ``api_url``; unset, it shares
    ``data_dir`` with the API."""
    worker_address: str | None = None
    """The address other machines reach this worker at (torchrun's rendezvous); default: this
    machine's IP on the route to the store's (or broker's) host."""
    shared_dir: Path | None = None
    """A directory this worker's machine shares with other worker machines (an NFS/CephFS/Lustre
    mount), at the same absolute path on each: multi-machine jobs placed on machines sharing one
    write their checkpoints there (``<shared_dir>/jobs/<id>/checkpoints/``), which lets
    ``method: full`` span machines (worker/shared_storage.py). Unset: none."""
    rdzv_port: int = Field(default=29400, ge=1, le=65535)
    """The port a multi-machine job's rank-0 machine listens on for torchrun's c10d rendezvous
    (the next free port upward if it is taken)."""
    transfer_retries: int = Field(default=4, ge=0)
    """Retries of one dataset download or artifact upload/download after a checksum mismatch, a
    truncated body, a 5xx or a connection error (backoff between tries)."""
    worker_upload_quota_gib: float = Field(default=200.0, gt=0)
    """The API: GiB one job's uploads from remote workers (checkpoints, final weights, exports)
    may occupy in its store once unpacked; an upload past it is 413 and leaves nothing. A full
    fine-tune of a large model keeps more (each checkpoint holds the optimizer state): raise it."""
    worker_upload_max_members: int = Field(default=10_000, ge=1)
    """The API: files and directories one upload's tar may hold (a checkpoint is a few)."""
    cpus: str | None = None
    """CPU cores this process and its children may run on (``0``, ``0-3``, ``0,2-3``; Linux), set
    per process: ``FTQ_CPUS=0 ftq api`` and ``FTQ_CPUS=1-15 ftq worker`` keep an API under load
    off the trainer's cores (core/affinity.py). Unset: all cores."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_bytes: int = 1 << 30
    """Largest dataset upload accepted (bytes)."""
    heartbeat_interval_s: float = 5.0
    """How often a running job's worker proves it is alive."""
    heartbeat_timeout_s: float = 60.0
    """A running job whose heartbeat is older than this is reaped (retried or failed)."""
    shrink_after_s: float = Field(default=120.0, ge=0)
    """A job over several machines that lost one and went back to the queue may resume on fewer
    machines (down to one, the same GPUs on each, the same global batch) once the machines of
    its previous attempt that are not live have been gone this long and no full set is live; 0:
    at once. A machine back within it (a quick reboot) resumes the job at full size. Read where
    jobs are placed: the workers (and the API, for start estimates)."""
    max_attempts: int = 3
    """Claims per job: a job whose worker was lost is retried from its last checkpoint until this."""
    max_running_jobs_per_user: int = Field(default=0, ge=0)
    """GPUs one user's running jobs may hold at once (a 1-GPU job counts 1, a 4-GPU job 4; a
    user's ``max_running_jobs`` overrides it); 0, the default, means no cap: the queue's order
    alone shares the GPUs. The name is older than multi-GPU jobs. Jobs created without an owner
    share one cap, as one anonymous user."""
    cancel_grace_s: float = 60.0
    """After a cancel, how long the trainer may take to checkpoint before it is killed."""
    event_flush_interval_s: float = 0.5
    """The worker writes buffered events to the store at least this often."""
    allow_hub_models: bool = True
    """Accept hub ids as ``model`` (resolved from the local HF cache when offline)."""
    tokenizer_workers: int = Field(default=2, ge=1)
    """Processes the API starts (on first use) to tokenize datasets (the submission preflight,
    previews, GET /v1/files/{id}/tokens); each imports transformers and keeps its last 4
    tokenizers loaded, the API process neither. One user's requests hold at most all of them
    but one, so another user's finds one free (api/files/tokenizer_pool.py)."""
    tokenizer_prestart: bool = True
    """Start one tokenizer process when the API starts, in the background, so the first
    submission's preflight does not wait 20-40 s for transformers to import (the test suite turns
    it off for the hundreds of in-process apps it makes: tests/conftest.py)."""
    tokenizer_budget_s: float = Field(default=60.0, gt=0)
    """Seconds one tokenizing request may hold a process: past it the process is killed and
    replaced and the request answers 422 naming the line it was on."""
    grader_cpu_s: int = Field(default=10, ge=1)
    """CPU seconds one python grader's ``grade`` call may use (``graders.run``; docs/graders.md)."""
    grader_wall_s: float = Field(default=20.0, gt=0)
    """Seconds one python grader's call may take, its interpreter's start included; then it is killed."""
    grader_memory_mib: int = Field(default=1024, ge=64)
    """Address space of one python grader's process, in MiB: past it an allocation fails."""
    record_max_messages: int = Field(default=10_000, ge=1)
    """Messages one chat record may have (a preference record's input and outputs together);
    checked before it is tokenized, a record over it is a 422 naming its line."""
    record_max_chars: int = Field(default=4_000_000, ge=1)
    """Characters of all one record's strings together (about a million tokens), checked the same way."""
    generate_max_len: int | None = Field(default=None, ge=1)
    """Tokens one sequence of a generation job may hold (its prompt + ``sampling.max_tokens``),
    below the model's own context; checked at submission (``core.jobs.prompt_lengths``). None:
    the model's ``max_position_embeddings`` alone."""
    session_start_wait_s: float = Field(default=120.0, ge=0)
    """How long a chat request for a model with no live session waits while one starts (queued,
    then loading); past it the request answers 503 with ``Retry-After`` and the session keeps starting."""
    session_idle_timeout_s: float = Field(default=600.0, gt=0)
    """A chat session with no request for this long ends by itself and frees its GPU."""
    session_max_len: int = Field(default=4096, ge=16)
    """Positions per sequence of a chat session (prompt + max_tokens), below the model's own context."""
    session_slots: int = Field(default=8, ge=1)
    """Sequences one chat session decodes together."""
    session_poll_interval_s: float = Field(default=0.05, gt=0)
    """How often the API and a session's worker look for new relay messages (``core.sessions.relay``)."""
    auth_failure_limit: int = Field(default=20, ge=0)
    """Failed requests per minute one stored key id may have (a wrong secret, revoked, disabled
    user), and one address with keys the store does not know (unknown id, malformed, none); past
    it that id, or that address's unknown keys, get 429 until the oldest leaves the minute. A
    valid key is never refused for other keys' failures (api/auth_throttle.py). 0: no limit."""
    sse_heartbeat_s: float = 15.0
    """An idle event stream sends a comment line this often so proxies keep it open."""
    sse_poll_interval_s: float = 0.4
    """Without Redis, an event stream re-reads the store this often; with Redis it is only
    the fallback for a missed wake-up (10x this)."""
    mlflow_tracking_uri: str | None = None
    """Every job on this box is tracked on this MLflow server (params, metrics by step, the adapter
    as an artifact) unless its spec turns tracking off; unset: only jobs that name a server. It is
    the default server ``mlflow`` of the allow-list (``tracking_servers``), sent the worker's
    ``MLFLOW_TRACKING_TOKEN``."""
    mlflow_experiment: str = "ftq"
    """The MLflow experiment of jobs that do not name one."""
    tensorboard_dir: Path | None = None
    """Every job writes TensorBoard event files under ``<this>/<job id>`` (``tensorboard --logdir``
    on it shows them all); unset: only jobs with ``tracking.tensorboard`` true, in their own directory."""
    wandb_project: str | None = None
    """Every job on this box is tracked on Weights & Biases in this project (the worker's
    ``WANDB_API_KEY``, ``WANDB_ENTITY``, ``WANDB_BASE_URL``) unless its spec turns tracking off;
    unset: only jobs that ask (``tracking.wandb``, ``tracking.wandb_project``)."""
    tracking_servers: dict[str, TrackingServer] = Field(default_factory=dict)
    """``FTQ_TRACKING_SERVERS``, JSON: the tracking servers jobs may name (``tracking.mlflow_server``,
    ``tracking.wandb_server``), ``{"team": {"kind": "mlflow", "url": "http://mlflow:5000",
    "credential_env": "MLFLOW_TEAM_TOKEN", "default": true}}``; set the same on the API (which
    refuses other names and URLs at submission) and on each worker (which sends each server only
    its own credential). ``FTQ_MLFLOW_TRACKING_URI`` adds a default server named ``mlflow``; with
    no W&B server listed, one named ``wandb`` is W&B as the worker's environment configures it.
    The lookup is ``core.jobs.trackers.allowed_trackers``."""

    @field_validator("tracking_servers")
    @classmethod
    def _check_tracking_servers(cls, servers: dict[str, TrackingServer]) -> dict[str, TrackingServer]:
        for name in servers:
            if not TRACKING_SERVER_NAME.match(name):
                raise ValueError(f"FTQ_TRACKING_SERVERS: {name!r} is not a server name: use 1-64 lowercase "
                                 "letters, digits, '.', '_' or '-', starting with a letter or digit")
        for kind in SERVER_TRACKERS:
            defaults = sorted(name for name, server in servers.items() if server.kind == kind and server.default)
            if len(defaults) > 1:
                raise ValueError(f"FTQ_TRACKING_SERVERS: {', '.join(defaults)} are all default {kind} servers; "
                                 "mark at most one of a kind default")
        return servers

    @model_validator(mode="after")
    def _check_legacy_mlflow(self) -> "Settings":
        if not self.mlflow_tracking_uri:
            return self
        if LEGACY_MLFLOW_SERVER in self.tracking_servers:
            raise ValueError(f"FTQ_MLFLOW_TRACKING_URI names the server {LEGACY_MLFLOW_SERVER!r}, which "
                             "FTQ_TRACKING_SERVERS lists too: list it once (there, with \"default\": true)")
        if any(s.kind == "mlflow" and s.default for s in self.tracking_servers.values()):
            raise ValueError("FTQ_MLFLOW_TRACKING_URI and a default MLflow server of FTQ_TRACKING_SERVERS: "
                             "keep one default (move the URI into FTQ_TRACKING_SERVERS)")
        if not TRACKING_SERVER_URL.match(self.mlflow_tracking_uri):
            raise ValueError(f"FTQ_MLFLOW_TRACKING_URI: {self.mlflow_tracking_uri!r} is not an http(s)://host[:port] "
                             "URL without user:password (the worker speaks MLflow's REST API to it)")
        return self

    def resolved(self) -> "Settings":
        data_dir = self.data_dir.expanduser().resolve()
        model_root = self.model_root.expanduser().resolve()
        return self.model_copy(
            update={
                "data_dir": data_dir,
                "model_root": model_root,
                "database_url": self.database_url or f"sqlite:///{data_dir / 'ftq.db'}",
                "broker_url": self.broker_url or f"sqla+sqlite:///{data_dir / 'broker.db'}",
            }
        )

    @property
    def remote_worker(self) -> bool:
        """A worker with a worker key: no shared disk, bytes go through the API."""
        return self.worker_key is not None and bool(self.worker_key.get_secret_value())

    def check_remote_worker(self) -> None:
        """Refuse a remote worker's settings that cannot work (called at worker start).

        Raises:
            ValueError: ``worker_key`` without ``api_url``, or a key or URL of the wrong shape.
        """
        if not self.remote_worker:
            return
        assert self.worker_key is not None
        if not self.worker_key.get_secret_value().startswith("ftqw_"):
            raise ValueError("FTQ_WORKER_KEY: not a worker key (they start with ftqw_); "
                             "make one with `ftq workers key create NAME` on the API's machine")
        if not self.api_url:
            raise ValueError("FTQ_API_URL: a worker with FTQ_WORKER_KEY needs the API's base URL "
                             "(e.g. http://mainbox:8000) to fetch datasets and upload checkpoints")
        if not self.api_url.startswith(("http://", "https://")):
            raise ValueError(f"FTQ_API_URL: {self.api_url!r} is not an http:// or https:// URL")

    @property
    def cache_dir(self) -> Path:
        """A remote worker's downloaded datasets, by sha256 (``cache/files/<sha256>``)."""
        return self.data_dir / "cache" / "files"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

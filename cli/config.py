"""The client's config file: which API to talk to and with which key.

Looked up at ``FTQ_CONFIG`` if set, else ``$XDG_CONFIG_HOME/ftq/config.toml`` (default
``~/.config/ftq/``), else ``config.json`` next to it. Keys: ``api_key`` and, optionally,
``api_url``, ``project`` (the project commands that create or list work use when given no
``--project``; ``ftq projects default NAME --local`` writes it) and ``hf_token`` (the Hugging
Face token ``ftq models pull`` sends when ``HF_TOKEN`` is unset; written by hand). The
environment wins over the file (``FTQ_API_KEY``, ``FTQ_API_URL``, ``FTQ_PROJECT``), so a one-off
command can use another key. ``ftq login`` and the first
``ftq up`` write the key, every ``ftq up`` the URL it serves on; the file has mode 0600: it
holds secrets.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from cli.errors import CliError

KNOWN_KEYS = ("api_key", "api_url", "hf_token", "project")


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ftq"


def config_path() -> Path:
    """The file to read (the first that exists) or to write (``config.toml``)."""
    explicit = os.environ.get("FTQ_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    toml, js = config_dir() / "config.toml", config_dir() / "config.json"
    return js if js.exists() and not toml.exists() else toml


def load_config(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        raise CliError(f"cannot read the ftq config {path}: {exc}; fix it, or write it again with `ftq login`") from exc
    if not isinstance(data, dict):
        raise CliError(f"the ftq config {path} must hold a table/object with api_key (and api_url)")
    return data


def save_config(values: dict[str, str], path: Path | None = None) -> Path:
    """Merge ``values`` into the config file and write it with mode 0600 (created so, never wider)."""
    path = path or config_path()
    data = {**load_config(path), **values}
    data = {k: str(v) for k, v in data.items() if k in KNOWN_KEYS and v}
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:  # JSON strings are valid TOML basic strings for what we store (URLs, keys)
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def api_key() -> str | None:
    """``FTQ_API_KEY``, else the config file's ``api_key``, else None."""
    return os.environ.get("FTQ_API_KEY") or load_config().get("api_key") or None


def default_project() -> str | None:
    """``FTQ_PROJECT``, else the config file's ``project``, else None (the box's default for the key)."""
    return os.environ.get("FTQ_PROJECT") or load_config().get("project") or None


def remember_api_url(url: str) -> Path | None:
    """Save ``url`` as ``api_url`` (``ftq up`` does, each start), so a new shell's client commands
    reach the API this box started, whatever ``FTQ_PORT`` it ran with. None when the file cannot be
    written: the caller warns, the service runs on."""
    try:
        return save_config({"api_url": url})
    except (OSError, CliError):
        return None


def configured_url() -> str | None:
    url = load_config().get("api_url")
    return str(url) if url else None

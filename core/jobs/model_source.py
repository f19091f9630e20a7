"""Where a job's base model comes from: a directory under the model root, or a hub id.

Rules, in order:

1. An absolute path, or a relative one, that names a directory under ``FTQ_MODEL_ROOT``
   holding ``config.json`` is a local model. ``..`` segments and absolute paths outside the
   root are refused: users may name only what the box's owner put there.
2. Otherwise a value shaped like ``org/name`` is a hub id (if ``allow_hub_models``). With
   ``HF_HUB_OFFLINE=1`` the box cannot download, so the model must already be in the local
   Hugging Face cache. At submission (``check_hub``) a hub id that is not in the cache is
   looked up on the hub (``HF_ENDPOINT``, one metadata request for its config.json, at most
   ``HUB_PROBE_TIMEOUT_S``): a box that cannot reach the hub, an id the hub does not know or a
   gated one is refused at the door instead of failing on the worker.
3. Anything else is refused with both options spelled out.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from core.errors import InvalidInput
from core.weights import INDEX_FILE, WeightsError, check_safetensors, check_shard_index

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class ModelSource:
    kind: str
    """``local`` or ``hub``."""
    name_or_path: str
    """The absolute directory for ``local``, the hub id for ``hub``: what the trainer loads."""


HUB_PROBE_TIMEOUT_S = 5.0
"""How long a submission waits for the hub to answer whether a model exists."""


def resolve_model(model: str, *, model_root: Path, allow_hub: bool = True, check_hub: bool = False) -> ModelSource:
    """Resolve the spec's ``model`` to what the trainer loads, or raise ``InvalidInput``.

    ``check_hub``: look a hub id that is not in the local cache up on the hub (submission only:
    the worker and the downloads trust what was accepted)."""
    root = model_root.expanduser().resolve()
    if ".." in PurePosixPath(model).parts or ".." in Path(model).parts:
        raise InvalidInput(
            f"model {model!r}: '..' is not allowed; name a directory under the model root ({root})",
            param="model",
        )
    if os.path.isabs(model):
        return ModelSource("local", str(_local_dir(Path(model), root, model)))
    candidate = root / model
    if _is_dir(candidate):
        return ModelSource("local", str(_local_dir(candidate, root, model)))
    if HUB_ID.match(model):
        if not allow_hub:
            raise InvalidInput(
                f"model {model!r}: hub models are disabled on this box (FTQ_ALLOW_HUB_MODELS=0) and "
                f"{candidate} does not exist; put the model under {root} and name its directory",
                param="model",
            )
        if _hub_offline() and not _in_hf_cache(model):
            raise InvalidInput(
                f"model {model!r}: HF_HUB_OFFLINE=1 and the model is not in the local Hugging Face "
                f"cache, and {candidate} does not exist; download it on a connected machine "
                f"(huggingface-cli download {model}) or put it under {root}",
                param="model",
            )
        if check_hub and not _hub_offline() and not _in_hf_cache(model):
            problem = _hub_problem(model)
            if problem:
                raise InvalidInput(
                    f"model {model!r}: not in this box's Hugging Face cache, and {problem}; download it on a "
                    f"connected machine (huggingface-cli download {model}) or put it under {root}",
                    param="model",
                )
        return ModelSource("hub", model)
    raise InvalidInput(
        f"model {model!r}: no directory {candidate} exists and it is not a hub id (org/name); "
        f"name a directory under the model root {root} that holds config.json, or a hub id",
        param="model",
    )


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, False for a name the file system cannot hold (ENAMETOOLONG) rather than an OSError."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _local_dir(path: Path, root: Path, given: str) -> Path:
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidInput(
            f"model {given!r}: {resolved} is outside the model root {root}; name a directory under it",
            param="model",
        )
    if not _is_dir(resolved):
        raise InvalidInput(
            f"model {given!r}: {resolved} is not a directory; name a model directory under {root}",
            param="model",
        )
    if not (resolved / "config.json").is_file():
        raise InvalidInput(
            f"model {given!r}: {resolved} has no config.json; name the directory of a saved "
            "Hugging Face model (save_pretrained output)",
            param="model",
        )
    return resolved


def check_model_files(directory: Path, given: str) -> dict[str, object]:
    """What can be checked of a local model without loading it; returns its parsed config.json.

    config.json must be a JSON object with a ``model_type``; weight files (``*.safetensors``,
    ``*.bin``) must be there, every shard a ``model.safetensors.index.json`` names too; each
    safetensors file must be exactly as long as its header declares (``core.weights``: a file cut
    short by an interrupted download is refused here, not when the worker loads it); and where
    safetensors headers (read without loading a tensor) hold the input embedding, its shape must
    be ``[vocab_size, hidden_size]`` and the decoder layers numbered in the names must be
    ``num_hidden_layers``: a config.json that claims 70B over tiny weights is refused here instead
    of failing on the worker.

    Raises:
        InvalidInput: naming the file and the mismatch.
    """
    def refuse(problem: str) -> InvalidInput:
        return InvalidInput(f"model {given!r}: {problem}", param="model")

    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"config.json does not parse ({exc}); write it with save_pretrained") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise refuse("config.json has no model_type; it is not a Hugging Face model config")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards and not any(directory.glob("*.bin")):
        raise refuse(f"{directory} has config.json but no weight files (*.safetensors or *.bin)")
    shapes: dict[str, list[int]] = {}
    try:
        missing = check_shard_index(directory)
        if missing:
            raise WeightsError(f"{INDEX_FILE} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                               "not in the directory; the download is incomplete: re-download it")
        for shard in shards:
            shapes.update(safetensors_shapes(shard))
    except WeightsError as exc:
        raise refuse(str(exc)) from None
    _check_shapes(config, shapes, refuse)
    return config


def _check_shapes(config: dict, shapes: dict[str, list[int]], refuse: Callable[[str], InvalidInput]) -> None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    embed = next((name for name in shapes if name.endswith("embed_tokens.weight")), None)
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if embed and isinstance(vocab, int) and isinstance(hidden, int) and shapes[embed] != [vocab, hidden]:
        raise refuse(
            f"config.json says vocab_size {vocab} and hidden_size {hidden}, but the weights' {embed} is "
            f"{shapes[embed]}: the config does not describe these weights"
        )
    layers = {int(m.group(1)) for name in shapes if (m := re.search(r"\.layers\.(\d+)\.", name))}
    wanted = text.get("num_hidden_layers")
    if layers and isinstance(wanted, int) and len(layers) != wanted:
        raise refuse(f"config.json says num_hidden_layers {wanted}, but the weights hold {len(layers)} layers")


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header, no tensor read; the file's size is
    checked against the header (``core.weights.check_safetensors``, raising ``WeightsError``)."""
    header = check_safetensors(path)
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("shape"), list)}


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_problem(repo_id: str) -> str | None:
    """None when the hub serves ``repo_id``'s config.json; else why the box cannot get the model."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None  # re-read: huggingface_hub fixes it at import
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", endpoint=endpoint), timeout=HUB_PROBE_TIMEOUT_S,
                             endpoint=endpoint)
    except GatedRepoError:
        return "the hub says it is gated (accept its licence and set HF_TOKEN on the box)"
    except (RepositoryNotFoundError, RemoteEntryNotFoundError, RevisionNotFoundError):
        return "the hub has no such model (or it has no config.json); check the id"
    except Exception as exc:  # noqa: BLE001 - any failure to reach the hub means the same to the user
        return f"the hub ({endpoint or 'https://huggingface.co'}) cannot be reached from this box ({type(exc).__name__})"
    return None


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    # HF_HUB_CACHE is re-read here: huggingface_hub fixes its default when first imported.
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE"))
    return isinstance(found, str)

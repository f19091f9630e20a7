"""``ftq models pull ORG/NAME``: a model from the Hugging Face hub into the model root, resumably.

Why the pull runs in the CLI, on the box, and not behind an API route: the model root is a
directory of the box (the API lists it, the box's workers load from it), a download of tens of
GB wants a progress bar and Ctrl-C on the terminal that started it, and an interrupted one is
continued by running the same command again. A route would need a background task, a progress
stream and a cancel route for the same thing.

A pull (``pull``):

1. asks the hub (``HF_ENDPOINT``, default huggingface.co; the token from ``HF_TOKEN`` or the
   config file's ``hf_token``) for the revision's files with their sizes and hashes, and keeps
   those a model needs at the repository's top level (``MODEL_FILES``): config, generation
   config, tokenizer files, safetensors weights and their index. No ``.bin`` pickles beside
   them, no ``onnx/``, ``gguf``, ``original/`` or Mistral's ``consolidated`` copy; a repository
   without safetensors weights is refused;
2. downloads them, pinned to the revision's commit, into ``<root>/.pull/ORG/NAME`` (hidden:
   neither ``GET /v1/models`` nor a job sees it), each as ``<file>.part`` renamed when whole.
   A ``.part`` left by an interrupted pull is continued with an HTTP ``Range`` request, and its
   bytes count towards the file's SHA-256 (LFS files; git's blob hash for the small ones), which
   must match the hub's. A staging directory of another commit is discarded;
3. checks every safetensors file against its header (``core.weights``: a file cut short on the
   hub, or here, is refused with its name) and config.json against the weights
   (``core.jobs.model_source.check_model_files``, the submission's own check); a file that fails
   is deleted from the staging directory, so the next pull downloads it again;
4. renames the staging directory to ``<root>/ORG/NAME``: one rename on one file system, so the
   model root never holds a half-installed model.

The files are fetched here rather than by ``huggingface_hub.snapshot_download``: since
huggingface_hub 1.18 a failed download deletes its partial file (huggingface/huggingface_hub#4306,
to keep concurrent downloads safe), so an interrupted snapshot starts that file over, which on a
5 GB shard cut at 4.9 GB means downloading it again. huggingface_hub still does the rest: the
file listing (``HfApi.model_info``), the URLs (``hf_hub_url``) and the token and user agent
headers (``build_hf_headers``).
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cli.errors import CliError

STAGING = ".pull"
"""The staging directory under the model root (hidden, so not listed as a model)."""
COMMIT_FILE = ".commit"
"""In a staging directory: the commit its files belong to."""
MODEL_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json", "*.safetensors",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "*.tiktoken",
    "chat_template.jinja", "chat_template.json",
)
"""Top-level files a pull keeps (``fnmatch`` patterns): what ``from_pretrained`` reads for a causal LM."""
TIMEOUT = httpx.Timeout(30.0, read=120.0)
BLOCK = 8 << 20
"""Bytes read at a time when hashing the part of a file an earlier pull left."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None
    """The LFS object's SHA-256 (weights); None for a file stored in git."""
    blob_id: str | None
    """The git blob id (SHA-1 of ``blob <size>\\0`` + content) of a file stored in git."""


def pull(repo_id: str, root: Path, *, revision: str | None = None, token: str | None = None,
         endpoint: str | None = None) -> Path:
    """Download ``repo_id`` at ``revision`` into ``root/repo_id`` (module docstring); returns it.

    ``endpoint`` is passed on because huggingface_hub reads ``HF_ENDPOINT`` once, at import.

    Raises:
        CliError: the target exists, the hub refuses or cannot be reached, the download stops
            (run again to continue), or a downloaded file fails its check (named).
    """
    target = root / repo_id
    if target.exists():
        raise CliError(f"{target} already exists; delete it to pull {repo_id} again")
    staging = root / STAGING / repo_id
    staging.mkdir(parents=True, exist_ok=True)
    again = f"`ftq models pull {repo_id}{f' --revision {revision}' if revision else ''}` again continues where it stopped"
    with _locked(root / STAGING / f"{repo_id.replace('/', '--')}.lock", repo_id), _removing_empty(staging, root):
        commit, files = list_files(repo_id, revision, token=token, endpoint=endpoint)
        _start_staging(staging, commit)
        _check_room(staging, files)
        print(f"pulling {repo_id} at {revision or 'main'} (commit {commit}): {len(files)} files, "
              f"{format_bytes(sum(f.size for f in files))}, into {target}", file=sys.stderr, flush=True)
        try:
            download(repo_id, commit, files, staging, token=token, endpoint=endpoint)
        except (httpx.HTTPError, OSError) as exc:  # a dropped connection, a full disk
            raise CliError(f"the download of {repo_id} stopped ({type(exc).__name__}: {exc}); {again}") from None
        except KeyboardInterrupt:
            print(f"\nftq: interrupted; {again}", file=sys.stderr)
            raise
        verify(staging, repo_id)
        (staging / COMMIT_FILE).unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(target)
    return target


def list_files(repo_id: str, revision: str | None, *, token: str | None,
               endpoint: str | None) -> tuple[str, list[RemoteFile]]:
    """The revision's commit and the files of it a pull keeps (``select_files``).

    Raises:
        CliError: what the hub answered (no such model or revision, gated), or that it cannot be reached.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    hub = endpoint or "https://huggingface.co"
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise CliError(f"{repo_id} is gated: accept its licence on its hub page, then set HF_TOKEN (or hf_token in "
                       "the ftq config file) to a token of that account") from None
    except RevisionNotFoundError:
        raise CliError(f"{repo_id} has no revision {revision!r}; name a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise CliError(f"the hub ({hub}) has no model {repo_id}, or it is private and HF_TOKEN is not a token "
                       "that may read it; check the id") from None
    except HfHubHTTPError as exc:
        raise CliError(f"the hub ({hub}) refused to list {repo_id}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's transport errors: one meaning to the user
        raise CliError(f"cannot reach the hub ({hub}): {type(exc).__name__}: {exc}; check the network, "
                       "or set HF_ENDPOINT to a mirror") from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = []
    for name in select_files(list(siblings)):
        s = siblings[name]
        files.append(RemoteFile(name, s.lfs.size if s.lfs else s.size or 0, s.lfs.sha256 if s.lfs else None,
                                None if s.lfs else s.blob_id))
    return str(info.sha), files


def select_files(names: list[str]) -> list[str]:
    """The top-level files of ``MODEL_FILES`` among ``names``, sorted; Mistral's ``consolidated``
    weights are dropped when the transformers shards are there too.

    Raises:
        CliError: no safetensors weights among them.
    """
    keep = sorted(n for n in names if "/" not in n and any(fnmatch.fnmatchcase(n, p) for p in MODEL_FILES))
    weights = [n for n in keep if n.endswith(".safetensors")]
    if not weights:
        others = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf", ".onnx")))
        raise CliError(f"no safetensors weights at the repository's top level (it has {', '.join(others[:5]) or 'no weights'}); "
                       "ftq pulls safetensors only: pick a repository that has them")
    if any(not n.startswith("consolidated") for n in weights):
        keep = [n for n in keep if not (n.startswith("consolidated") and n.endswith(".safetensors"))]
    return keep


def download(repo_id: str, commit: str, files: list[RemoteFile], staging: Path, *, token: str | None,
             endpoint: str | None) -> None:
    """Fetch each of ``files`` not yet whole in ``staging``, continuing its ``.part``; one progress bar."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, tqdm

    headers = build_hf_headers(token=token, library_name="ftq")
    todo = [f for f in files if not _is_whole(staging / f.name, f)]
    done = sum(f.size for f in files) - sum(f.size for f in todo)
    with (httpx.Client(headers=headers, follow_redirects=True, timeout=TIMEOUT) as http,
          tqdm(total=sum(f.size for f in files), initial=done, unit="B", unit_scale=True, desc=repo_id) as bar):
        for remote in todo:
            url = hf_hub_url(repo_id, remote.name, revision=commit, endpoint=endpoint)
            _fetch(http, url, staging / remote.name, remote, bar)


def _fetch(http: httpx.Client, url: str, path: Path, remote: RemoteFile, bar: Any) -> None:
    """Download ``url`` to ``path`` through ``path.part``, continuing what is there; check size and hash."""
    part = path.with_name(path.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    digest = _hasher(remote)
    if have:
        _hash_existing(part, digest)
        bar.update(have)
    if have < remote.size or not remote.size:
        with http.stream("GET", url, headers={"Range": f"bytes={have}-"} if have else {}) as response:
            if response.status_code >= 400:
                raise CliError(f"{remote.name}: the hub answered {response.status_code} "
                               f"({response.read()[:300].decode(errors='replace')}); run the pull again")
            if have and response.status_code != 206:  # the server ignored the range: start over
                bar.update(-have)
                have, digest = 0, _hasher(remote)
            with part.open("ab" if have else "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = part.stat().st_size
    if size != remote.size:
        raise CliError(f"{remote.name}: received {size:,} bytes, the hub lists {remote.size:,}; run the pull again")
    if (remote.sha256 or remote.blob_id) and digest.hexdigest() != (remote.sha256 or remote.blob_id):
        part.unlink()
        raise CliError(f"{remote.name}: its hash does not match the hub's (damaged in transfer); it was deleted: "
                       "re-download it by running the pull again")
    part.rename(path)


def _hasher(remote: RemoteFile) -> Any:
    if remote.sha256:
        return hashlib.sha256()
    digest = hashlib.sha1(usedforsecurity=False)  # git's blob id, not a security check
    digest.update(f"blob {remote.size}\0".encode())
    return digest


def _hash_existing(part: Path, digest: Any) -> None:
    with part.open("rb") as fh:
        while block := fh.read(BLOCK):
            digest.update(block)


def _is_whole(path: Path, remote: RemoteFile) -> bool:
    """A file a pull renamed into place (after its size and hash checks) is whole."""
    return path.is_file() and path.stat().st_size == remote.size


def verify(directory: Path, repo_id: str) -> None:
    """Check each safetensors file against its header, then config.json against the weights.

    Raises:
        CliError: naming the file; a damaged safetensors file is deleted, so a new pull fetches it.
    """
    from core.errors import InvalidInput
    from core.jobs.model_source import check_model_files
    from core.weights import WeightsError, check_safetensors

    for path in sorted(directory.glob("*.safetensors")):
        try:
            check_safetensors(path)
        except WeightsError as exc:
            path.unlink()
            raise CliError(f"{repo_id}: {exc}. Nothing was installed; `ftq models pull {repo_id}` downloads the "
                           "file again (if it fails the same way, the hub's copy is damaged)") from None
    try:
        check_model_files(directory, repo_id)
    except InvalidInput as exc:
        raise CliError(f"{exc.message}. Nothing was installed") from None


def _start_staging(staging: Path, commit: str) -> None:
    """Keep what an earlier pull of the same commit left in ``staging``; discard another commit's."""
    marker = staging / COMMIT_FILE
    if marker.is_file() and marker.read_text().strip() != commit:
        shutil.rmtree(staging)
        staging.mkdir(parents=True)
    marker.write_text(commit + "\n")


def _check_room(staging: Path, files: list[RemoteFile]) -> None:
    have = sum(p.stat().st_size for f in files for p in (staging / f.name, staging / f"{f.name}.part") if p.is_file())
    need = sum(f.size for f in files) - have
    free = shutil.disk_usage(staging).free
    if need > free:
        raise CliError(f"the model needs {format_bytes(need)} more and {staging.parent} has {format_bytes(free)} free; "
                       "free some space, or pass --model-root on a larger disk")


@contextmanager
def _locked(path: Path, repo_id: str) -> Iterator[None]:
    """One pull of ``repo_id`` at a time. The lock file stays: deleting it would let a third
    pull lock a new file while a second still holds the old one."""
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CliError(f"another `ftq models pull {repo_id}` is running; wait for it") from None
        yield


@contextmanager
def _removing_empty(staging: Path, root: Path) -> Iterator[None]:
    """On the way out, remove the staging directory and its parents below ``root / STAGING``
    while they are empty, so a pull refused before its first byte leaves nothing behind."""
    try:
        yield
    finally:
        marker = staging / COMMIT_FILE
        if marker.is_file() and not any(p != marker for p in staging.iterdir()):
            marker.unlink()
        directory = staging
        while root / STAGING in directory.parents:
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # not empty; no `return` here: in a `finally` it would swallow the error
                break
            directory = directory.parent


def format_bytes(size: float) -> str:
    """``540.2 MB``, ``1.4 GB`` (powers of 1000, as the hub shows sizes)."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"

"""Installs: the lock, the Makefile's install steps and the torch build they choose.

`make up`, `make test` and .ci/run install from requirements/lock.txt; these tests hold the lock
to pyproject.toml's ranges, the venv the suite runs in to the lock, `make up SERVICE_EXTRAS=…` to
installing into an existing venv, and scripts/install-torch.sh to its choice of build.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"


def _lock() -> dict[str, tuple[Version, Marker | None]]:
    """name -> (version, marker) for each lock line that applies to this interpreter."""
    pins: dict[str, tuple[Version, Marker | None]] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0] in "# ":
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (spec,) = requirement.specifier
        assert spec.operator == "==", line
        pins[canonicalize_name(requirement.name)] = (Version(spec.version), requirement.marker)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(d) for d in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        declared += [Requirement(d) for d in extra]
    return [r for r in declared if r.marker is None or r.marker.evaluate()]


class TestLock:
    def test_every_declared_dependency_is_pinned_within_its_range(self) -> None:
        pins = _lock()
        for requirement in _declared():
            name = canonicalize_name(requirement.name)
            if name == "torch":
                assert name not in pins, "torch is installed per machine (scripts/install-torch.sh), not locked"
                continue
            assert name in pins, f"{requirement.name} is declared in pyproject.toml but not locked: run `make lock`"
            pinned, _ = pins[name]
            assert requirement.specifier.contains(pinned, prereleases=True), (
                f"the lock pins {requirement.name}=={pinned}, outside pyproject's {requirement.specifier}: run `make lock`"
            )

    def test_no_cuda_runtime_wheels_in_the_lock(self) -> None:
        names = [n for n in _lock() if n.startswith(("nvidia-", "cuda-"))]
        assert names == [], "the CUDA wheels follow the machine's torch build, not the lock"

    def test_the_suite_runs_on_the_locked_versions(self) -> None:
        if os.environ.get("FTQ_UNLOCKED"):
            pytest.skip("FTQ_UNLOCKED: this venv follows the newest releases, not the lock")
        off = []
        for name, (pinned, _) in _lock().items():
            try:
                installed = Version(version(name))
            except PackageNotFoundError:
                continue  # an extra this venv did not install
            if installed != pinned:
                off.append(f"{name} {installed} (lock {pinned})")
        assert off == [], f"installed versions differ from requirements/lock.txt; reinstall with `make install-dev`: {off}"


def _make(*args: str, venv: Path) -> str:
    result = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={venv}", *args],
        capture_output=True, text=True, check=True,
    )
    return result.stdout


@pytest.fixture
def installed_venv(tmp_path: Path) -> Path:
    """A venv folder whose plain (no extras) install and uv are newer than pyproject.toml and the lock."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stamps = (".venv-created", ".ftq-installed", "bin/uv")
    for stamp in stamps:
        (venv / stamp).touch()
    newer = max(ROOT.joinpath("pyproject.toml").stat().st_mtime, LOCK.stat().st_mtime) + 60
    for stamp in stamps:
        os.utime(venv / stamp, (newer, newer))
    return venv


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
class TestMakeInstall:
    def test_an_installed_venv_is_not_installed_again(self, installed_venv: Path) -> None:
        assert "pip install" not in _make("install", venv=installed_venv)

    def test_service_extras_install_into_an_existing_venv(self, installed_venv: Path) -> None:
        commands = _make("install", "SERVICE_EXTRAS=tracking,qlora", venv=installed_venv)
        uv = f"{installed_venv}/bin/uv pip install --compile-bytecode --python {installed_venv}/bin/python"
        assert f"{uv} -c requirements/lock.txt -e '.[tracking,qlora]'" in commands
        assert "pip install -q -c requirements/lock.txt uv" not in commands  # uv is there already
        assert f"touch {installed_venv}/.ftq-installed-tracking-qlora" in commands

    def test_every_install_goes_through_the_lock(self, tmp_path: Path) -> None:
        commands = _make("install-dev", venv=tmp_path / "new")
        pip = [c for c in commands.splitlines() if "pip install" in c]
        assert pip and all("-c requirements/lock.txt" in c for c in pip), pip
        assert any("-m pip install -q -c requirements/lock.txt uv" in c for c in pip), pip  # uv at its locked version
        assert any("uv pip install" in c and "-e '.[dev]'" in c for c in pip), pip
        uv = [c for c in pip if "/bin/uv pip install" in c]
        assert uv and all("--compile-bytecode" in c for c in uv), uv  # see the Makefile: no .pyc, every start compiles

    def test_the_test_run_and_the_service_start_compile_ftq_s_own_packages_first(self, installed_venv: Path) -> None:
        for target in ("test", "up"):
            commands = _make(target, venv=installed_venv).splitlines()
            compiled = [i for i, c in enumerate(commands) if "-m compileall" in c and " trainer " in c]
            started = [i for i, c in enumerate(commands) if "-m pytest" in c or "ftq up" in c]
            assert compiled and started and compiled[0] < started[0], (target, commands)


# -- scripts/install-torch.sh: which build ---------------------------------------------------

FAKE_PYTHON = """#!/bin/sh
# "import torch" fails (no torch yet); pip records its arguments; anything else is real Python
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "$@" > "$PIP_ARGS"; exit 0; fi
exec {python} "$@"
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def torch_index() -> Iterator[str]:
    """A local index that answers for /torch/ (reachable, like PyTorch's CPU index)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path.rstrip("/").endswith("/torch") else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def _install_torch(fake_python: Path, tmp_path: Path, env: dict[str, str], driver: bool = False) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n" if driver else "#!/bin/sh\nexit 1\n")
    smi.chmod(0o755)
    args_file = tmp_path / "pip-args"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-torch.sh"), str(fake_python), "2.13.0", "requirements/lock.txt"],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_ARGS": str(args_file),
             "TORCH_INDEX_URL": "", **env},
    )
    assert args_file.exists(), result.stdout + result.stderr
    return args_file.read_text().split()


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this machine has an NVIDIA driver")
class TestInstallTorch:
    def test_no_driver_takes_the_cpu_build_from_the_cpu_index(self, fake_python, tmp_path, torch_index) -> None:
        args = _install_torch(fake_python, tmp_path, {"TORCH_CPU_INDEX_URL": torch_index})
        assert args[-3:] == ["--extra-index-url", torch_index, "torch==2.13.0+cpu"]
        assert args[:3] == ["install", "-c", "requirements/lock.txt"]

    def test_an_unreachable_cpu_index_falls_back_to_the_configured_indexes(self, fake_python, tmp_path) -> None:
        args = _install_torch(fake_python, tmp_path, {"TORCH_CPU_INDEX_URL": "http://127.0.0.1:9/whl/cpu"})
        assert args[-1] == "torch==2.13.0" and "--extra-index-url" not in args

    def test_a_driver_takes_the_default_cuda_build(self, fake_python, tmp_path, torch_index) -> None:
        args = _install_torch(fake_python, tmp_path, {"TORCH_CPU_INDEX_URL": torch_index}, driver=True)
        assert args[-1] == "torch==2.13.0" and "--extra-index-url" not in args

    def test_torch_index_url_overrides_the_choice(self, fake_python, tmp_path, torch_index) -> None:
        args = _install_torch(fake_python, tmp_path, {"TORCH_INDEX_URL": "default", "TORCH_CPU_INDEX_URL": torch_index})
        assert args[-1] == "torch==2.13.0" and "--extra-index-url" not in args
        mirror = torch_index.replace("/cpu", "/cu130")
        args = _install_torch(fake_python, tmp_path, {"TORCH_INDEX_URL": mirror})
        assert args[-3:] == ["--extra-index-url", mirror, "torch==2.13.0"]


def test_the_readme_names_the_lock_and_the_torch_choice() -> None:
    text = (ROOT / "README.md").read_text()
    assert "requirements/lock.txt" in text and "TORCH_INDEX_URL" in text
    assert re.search(r"make test-latest", text)

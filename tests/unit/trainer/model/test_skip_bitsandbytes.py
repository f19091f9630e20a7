"""``trainer.model.imports``: a process that loads no 4-bit model does not import bitsandbytes
through peft, and still reports it installed (each case in a child process: the marking is
process-wide)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed here (nothing to skip)")

PROBE = """
import json, sys
from trainer.model.imports import skip_bitsandbytes
marked = skip_bitsandbytes(quantized={quantized})
import peft  # peft.helpers imports bitsandbytes when it looks available
from trainer.plan.hardware import detect
print(json.dumps({{"marked": marked, "imported": sys.modules.get("bitsandbytes") is not None,
                  "facts": detect("cpu").bitsandbytes}}))
"""


def _probe(quantized: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(quantized=quantized)], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_an_unquantized_process_never_imports_it_and_still_reports_it_installed():
    assert _probe(quantized=False) == {"marked": True, "imported": False, "facts": True}


def test_a_qlora_process_imports_it_as_before():
    assert _probe(quantized=True) == {"marked": False, "imported": True, "facts": True}

"""What the export end-to-end test runs outside the stack: a fresh process that loads the adapter
zip knowing only the base's name, greedy tokens from transformers and from llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

PROMPT = [{"role": "user", "content": "the cat sat on a mat"}]
NEW_TOKENS = 10

# Run with cwd = a directory that holds the base under its name (a stand-in for another machine's
# model root) and HF_HUB_OFFLINE=1: the adapter's own files must say everything else.
FRESH_PROCESS = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

adapter, merged, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompt = json.loads(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(adapter)  # the tokenizer shipped in the zip
ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)

def greedy(model):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]

print(json.dumps({
    "base": PeftConfig.from_pretrained(adapter).base_model_name_or_path,
    "ids": list(ids),
    "adapter": greedy(AutoPeftModelForCausalLM.from_pretrained(adapter).eval()),
    "merged": greedy(AutoModelForCausalLM.from_pretrained(merged).eval()),
    "chat_template": tokenizer.chat_template,
}))
"""


def fresh_process_greedy(model_root: Path, adapter_dir: Path, merged_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTQ_", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(adapter_dir), str(merged_dir), str(NEW_TOKENS),
                          json.dumps(PROMPT)], cwd=model_root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_greedy(path: Path, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False, seed=0)
    try:
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                return out
        return out
    finally:
        llm.close()


def wait_export(client: httpx.Client, job_id: str, export_id: str, *, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        export = client.get(f"/v1/jobs/{job_id}/exports/{export_id}").json()
        seen.add(export["status"])
        if export["status"] in ("succeeded", "failed"):
            return export
        time.sleep(0.3)
    raise AssertionError(f"export {export_id} never finished; last seen {export} (statuses {seen})")

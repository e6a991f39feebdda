"""The ecosystem's tools on what distlm writes: `transformers serve` and `AutoModelForCausalLM` load
the trained folder of the tiny workflow unchanged."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from distlm.dist import free_port
from distlm.inference.peer import transformers_serve_command, transformers_serve_env


def post(base: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_transformers_serve(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            transformers_serve_command(folder, port=port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=transformers_serve_env(1),
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"transformers serve exited:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"transformers serve did not come up:\n{log.read_text()[-4000:]}")


def test_trained_folder_loads_in_transformers_serve_and_automodel(workflow_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = workflow_run / "results" / "train" / "final"
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    prompt = "The class"
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    proc, base = start_transformers_serve(final, tmp_path / "transformers-serve.log")
    try:
        doc = post(base, {"model": str(final), "prompt": prompt, "max_tokens": 6, "temperature": 0})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    assert doc["choices"][0]["text"] == want
    assert doc["usage"]["completion_tokens"] == len(out[0]) - ids.shape[1]
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before  # loaded as it is

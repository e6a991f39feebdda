"""Serve mode: a real MPI pipeline behind HTTP, driven by the openai client and plain HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_inference
from test_inference import PROMPTS, write_config

from distlm.dist import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "workflow" / "scripts" / "serve.py"
# the session fixtures of test_inference.py: the tiny model folders and the `generate` reference
tiny_models = test_inference.tiny_models
hf_reference = test_inference.hf_reference
TOKEN = "t0ken"


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, body: bytes | dict | None = None, *, token: str | None = TOKEN,
                headers: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text


def start_server(folder: Path, stages: int, tmp: Path, **over) -> Server:
    port = free_port()
    serve = {"port": port, "token": TOKEN, "max_request_bytes": 2048, "max_tokens": 20}
    cfg = write_config(tmp / "cfg.json", stages=stages, lanes=4, serve=serve, **over)
    log = tmp / "serve.log"
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(SERVE), "--launcher", f"mpiexec -n {stages}", "--config", str(cfg),
             "--model", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    server = Server(proc, port, log)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if server.request("GET", "/health", timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise AssertionError(f"server did not come up:\n{log.read_text()[-4000:]}")


def stop_server(server: Server) -> None:
    """SIGTERM to the front (it stops the pipeline job), SIGKILL if that takes too long."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    s = start_server(tiny_models[2], 2, tmp_path_factory.mktemp("serve"), timeout_s=30)
    yield s
    stop_server(s)


def client(server: Server, token: str = TOKEN):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)


def test_health_and_models(server):
    status, h = server.request("GET", "/health", token=None)
    assert status == 200 and h["status"] == "ok" and h["stages"] == 2
    assert [p["stage"] for p in h["pipeline"]] == [0, 1]
    assert client(server).models.list().data[0].id == "s2"


def test_openai_client_greedy_matches_generate_and_streams(server, hf_reference):
    c = client(server)
    tok = hf_reference.tokenizer
    r = c.completions.create(model="s2", prompt=PROMPTS[0], max_tokens=9, temperature=0)
    want = tok.decode(hf_reference(PROMPTS[0], 9), skip_special_tokens=True)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 9 and r.usage.prompt_tokens == len(tok(PROMPTS[0])["input_ids"])
    chunks = list(c.completions.create(model="s2", prompt=PROMPTS[0], max_tokens=9, temperature=0, stream=True))
    assert len(chunks) >= 2 and "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    # a list of prompts: one choice each
    r = c.completions.create(model="s2", prompt=PROMPTS[:3], max_tokens=5, temperature=0)
    assert [ch.text for ch in r.choices] == [
        tok.decode(hf_reference(p, 5), skip_special_tokens=True) for p in PROMPTS[:3]
    ]


def test_seeded_sampling_is_reproducible_under_concurrency(server):
    c = client(server)
    ask = lambda seed: c.completions.create(
        model="s2", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
        extra_body={"top_k": 40},
    ).choices[0].text
    first = ask(5)
    with ThreadPoolExecutor(6) as ex:  # more requests than lanes, all at once
        again = list(ex.map(ask, [5] * 6))
    assert again == [first] * 6
    assert {ask(s) for s in (6, 7, 8)} != {first}


def test_concurrent_requests_each_get_their_own_answer(server, hf_reference):
    tok = hf_reference.tokenizer

    def ask(p):
        return server.request("POST", "/v1/completions", {"prompt": p, "max_tokens": 7, "temperature": 0})

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(ask, PROMPTS * 2))
    for p, (status, body) in zip(PROMPTS * 2, results):
        assert status == 200, body
        assert body["choices"][0]["text"] == tok.decode(hf_reference(p, 7), skip_special_tokens=True)


def test_plain_http_stream(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 6, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}",
                                                    "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6


BAD = [
    # (body, status, param, message fragment)
    ({"prompt": "", "max_tokens": 4}, 400, "prompt", "empty prompt"),
    ({"max_tokens": 4}, 400, "prompt", "prompt: required"),
    ({"prompt": [1, 2], "max_tokens": 4}, 400, "prompt", "expected a string"),
    ({"prompt": "A class", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"prompt": "A class", "max_tokens": -2}, 400, "max_tokens", "at least 1"),
    ({"prompt": "A class", "max_tokens": 100}, 400, "max_tokens", "beyond the model's context of 64"),
    ({"prompt": "A class", "max_tokens": 30}, 400, "max_tokens", "above this server's limit of 20"),
    ({"prompt": "A class", "max_tokens": "5"}, 400, "max_tokens", "expected an integer"),
    ({"prompt": "A class", "temperature": -0.5}, 400, "temperature", "must be >= 0"),
    ({"prompt": "A class", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "A class", "top_p": 1.01}, 400, "top_p", "(0, 1]"),
    ({"prompt": "A class", "n": 2}, 400, "n", "not supported"),
    ({"prompt": "A class", "stream": "yes"}, 400, "stream", "true or false"),
    (b"\xff\xfe{}", 400, None, "not valid UTF-8"),
    (b'{"prompt": "A class", ', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "expected a JSON object"),
    (json.dumps({"prompt": "x" * 3000}).encode(), 413, None, "over the limit of 2048"),
]


@pytest.mark.parametrize("body,status,param,fragment", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_json(server, body, status, param, fragment):
    got, err = server.request("POST", "/v1/completions", body)
    assert got == status, err
    assert fragment in err["error"]["message"] and err["error"]["param"] == param
    assert err["error"]["type"] == "invalid_request_error"


def test_auth_routes_and_limits(server):
    import openai

    assert server.request("POST", "/v1/completions", {"prompt": "A"}, token=None)[0] == 401
    status, err = server.request("POST", "/v1/completions", {"prompt": "A"}, token="wrong")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").completions.create(model="s2", prompt="A", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client(server).completions.create(model="s2", prompt="A", max_tokens=2, top_p=2.0)
    assert server.request("GET", "/nope")[0] == 404
    assert server.request("GET", "/v1/completions")[0] == 405


def test_long_prompt_truncated_and_said_so_then_still_serving(server):
    status, body = server.request("POST", "/v1/completions", {"prompt": "word " * 120, "max_tokens": 10})
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["prompt_truncated_tokens"] > 0 and "dropped its first" in body["warnings"][0]
    assert body["usage"]["prompt_tokens"] == 64 - 10
    status, h = server.request("GET", "/health")
    assert status == 200 and h["active"] == 0 and h["waiting"] == 0


def test_long_prompt_rejected_when_configured_and_clean_shutdown(tiny_models, tmp_path):
    s = start_server(tiny_models[2], 2, tmp_path, prompt_overflow="reject", timeout_s=30)
    try:
        status, err = s.request("POST", "/v1/completions", {"prompt": "word " * 120, "max_tokens": 10})
        assert status == 400 and "exceed the model's context of 64" in err["error"]["message"]
        assert err["error"]["param"] == "prompt"
        assert s.request("POST", "/v1/completions", {"prompt": "A class", "max_tokens": 3})[0] == 200
        # Ctrl-C on the front: stage 0 stops the other stages through the ring, the job ends cleanly
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
        log = s.log.read_text()
        assert "server stopped; per-stage time" in log and "pipeline stopped (exit code 0)" in log
    finally:
        stop_server(s)


def test_hung_stage_gives_503_and_the_job_ends(tiny_models, tmp_path):
    s = start_server(tiny_models[2], 2, tmp_path, timeout_s=3)
    pid = s.request("GET", "/health")[1]["pipeline"][1]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # stage 1 stops answering (alive, so the launcher does not notice)
        t0 = time.monotonic()
        status, err = s.request("POST", "/v1/completions", {"prompt": "A class", "max_tokens": 5}, timeout=60)
        assert status == 503, err
        assert "no tokens back from the pipeline" in err["error"]["message"]
        assert time.monotonic() - t0 < 20
        s.proc.wait(timeout=60)  # stage 0 aborts the job after answering, and the front exits with it
        assert s.proc.returncode != 0
        log = s.log.read_text()
        assert "pipeline failed, answering 503" in log and "the pipeline job ended (exit code" in log
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop_server(s)


def test_killed_stage_gives_503_and_the_job_ends(tiny_models, tmp_path):
    # The launcher kills every rank when one is killed, stage 0 included: the front answers. timeout_s
    # is long, so the quick 503 does not come from stage 0's deadline.
    s = start_server(tiny_models[3], 3, tmp_path, timeout_s=120)
    pid = s.request("GET", "/health")[1]["pipeline"][2]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # requests stay in flight until the stage dies
        body = {"prompt": "A class", "max_tokens": 5}
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(s.request, "POST", "/v1/completions", body, timeout=60)
            stream = pool.submit(s.request, "POST", "/v1/completions", {**body, "stream": True}, timeout=60)
            deadline = time.monotonic() + 30
            while s.request("GET", "/health")[1]["active"] < 2:
                assert time.monotonic() < deadline, "the requests never reached the pipeline"
                time.sleep(0.1)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            status, err = plain.result()
            assert status == 503, err
            assert "the pipeline job ended (exit code" in err["error"]["message"]
            assert err["error"]["type"] == "service_unavailable"
            status, text = stream.result()  # the 200 and its headers went out with the stream's start
            assert status == 200 and '"type": "service_unavailable"' in text and "[DONE]" not in text
            assert time.monotonic() - t0 < 20
        assert s.proc.wait(timeout=60) != 0  # the front exits with the job's exit code
        assert "a response was cut short" in s.log.read_text()
    finally:
        stop_server(s)


def test_front_tells_a_complete_response_from_a_cut_one():
    from distlm.inference.front import ResponseWatch

    def watch(*chunks):
        w = ResponseWatch()
        for c in chunks:
            w.feed(c)
        return w

    head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n"
    assert watch(head[:20], head[20:], b"0123456789").complete()
    assert not watch(head, b"01234").complete()
    assert not watch(b"HTTP/1.0 200 OK\r\nContent-").complete()
    assert not watch().complete()
    sse = b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    assert watch(sse, b'data: {"choices": []}\n\n', b"data: [DONE]\n\n").complete()
    assert watch(sse, b'data: {"error": {"message": "x"}}\n\n').complete()
    w = watch(sse, b'data: {"choices": []}\n\n')
    assert not w.complete() and w.sse and w.sent > 0
    assert not watch(sse, b"data: [DO").complete()


def _front(tmp_path, launcher: str) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    cfg = write_config(tmp_path / "cfg.json", stages=2, serve={"port": port})
    log = tmp_path / "front.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(SERVE), "--launcher", launcher, "--config", str(cfg), "--model", str(tmp_path)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return proc, port, log


def test_front_answers_503_while_the_pipeline_starts_and_stops_on_sigterm(tmp_path):
    # a "launcher" that never starts a pipeline: the front stays in its starting state
    proc, port, log = _front(tmp_path, f"{sys.executable} -c 'import time; time.sleep(120)'")
    try:
        s = Server(proc, port, log)
        deadline = time.monotonic() + 60
        while True:
            try:
                status, h = s.request("GET", "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.2)
        assert status == 503 and h["status"] == "starting"
        status, err = s.request("POST", "/v1/completions", {"prompt": "A class"})
        assert status == 503 and err["error"]["type"] == "service_unavailable"
        assert "the pipeline is starting" in err["error"]["message"]
        proc.terminate()
        assert proc.wait(timeout=30) != 0  # the job was killed before it was ready
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_front_exits_with_the_job_when_it_fails_to_start(tmp_path):
    proc, _, log = _front(tmp_path, f"{sys.executable} -c 'import sys; sys.exit(3)'")
    assert proc.wait(timeout=60) == 3
    assert "the pipeline job exited with code 3 before it was ready" in log.read_text()


def test_front_names_the_config_keys_when_its_port_is_taken():
    import socket

    from distlm import DistlmError
    from distlm.inference.front import Front

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(DistlmError, match=rf"cannot listen on 127.0.0.1:{port} \(inference.serve.host/port\)"):
            Front(["true"], [], host="127.0.0.1", port=port, start_timeout_s=1, stop_timeout_s=1)

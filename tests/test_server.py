"""Serve mode: the API server (uvicorn) with a real MPI pipeline behind it, driven by the openai
client and plain HTTP. Hostile clients and the soak are in test_serve_hostile.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
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

from distlm import DistlmError
from distlm.runtime.dist import free_port

# Every test here talks to a real server and its MPI job: not in the fast loop.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SERVE = "distlm.entry.serve"  # the serve entry point, as rule serve starts it
# the session fixtures of test_inference.py: the tiny model folders and the `generate` reference
tiny_models = test_inference.tiny_models
hf_reference = test_inference.hf_reference
TOKEN = "t0ken"
TOKEN_ENV = "DISTLM_TEST_SERVE_TOKEN"
# the shared server's RLIMIT_NOFILE, soft and hard (it raises the soft limit to the hard one at
# start): above the 1,000 idle connections test_serve_hostile holds open, below the 1,300 it opens
# to run the server out of descriptors
NOFILE = 1100
# the shared server's inference.max_new_tokens: a request without max_tokens gets this many
DEFAULT_MAX_TOKENS = 7
# the shared server's limits (small, so that the hostile tests reach them quickly)
LIMITS = {
    "token_env": TOKEN_ENV,
    "max_request_bytes": 2048,
    "max_header_bytes": 4096,
    "max_tokens": 20,
    "header_timeout_s": 2,
    "body_timeout_s": 2,
    "keep_alive_timeout_s": 2,
    "max_queued_sequences": 4,
    "max_json_depth": 16,
    "max_number_digits": 32,
}


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, folder: Path) -> None:
        self.proc, self.port, self.log, self.folder = proc, port, log, folder
        self.base = f"http://127.0.0.1:{port}"

    def logged(self, pattern: str, timeout_s: float = 60) -> None:
        """Wait until the server's log has a line matching `pattern`."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.log.read_text()):
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        *,
        token: str | None = TOKEN,
        headers: dict | None = None,
        timeout: float = 60,
    ) -> tuple[int, dict | str]:
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

    def ok(self) -> None:
        """A normal request must succeed (after every hostile case)."""
        status, body = self.request(
            "POST", "/v1/completions", {"prompt": "A class", "max_tokens": 3}
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3

    def health(self) -> dict:
        status, h = self.request("GET", "/health")
        assert status == 200, h
        return h

    def lanes_free(self, within_s: float = 15) -> bool:
        """Whether stage 0 reports every lane free and nothing queued (it reports every 0.5 s)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            h = self.health()
            if h["lanes_busy"] == 0 and h["waiting"] == 0 and h["open"] == 0:
                return True
            time.sleep(0.1)
        return False

    def metrics(self) -> dict[str, float]:
        """/metrics as {series with labels: value}."""
        req = urllib.request.Request(self.base + "/metrics")
        req.add_header("Authorization", f"Bearer {TOKEN}")
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def start_server(
    folder: Path,
    stages: int,
    tmp: Path,
    *,
    serve: dict | None = None,
    launcher: str | None = None,
    nofile: int | None = None,
    wait: bool = True,
    runtime: dict | None = None,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    **over,
) -> Server:
    port = free_port()
    over.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)  # within LIMITS' max_tokens
    cfg = write_config(
        tmp / "cfg.json",
        stages=stages,
        serve={**LIMITS, "port": port, **(serve or {})},
        runtime=runtime,
        **over,
    )
    log = tmp / "serve.log"
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                SERVE,
                "--launcher",
                launcher or f"mpiexec -n {stages}",
                "--config",
                str(cfg),
                "--model",
                str(folder),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", TOKEN_ENV: TOKEN},
        )
    if nofile:  # before it listens (it loads the tokenizer first); the job inherits it
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
    server = Server(proc, port, log, folder)
    if not wait:
        return server
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
    """SIGTERM to the API server (it stops the pipeline job), SIGKILL if that takes too long."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


_SHARED: dict = {"server": None, "users": 0}


@pytest.fixture(scope="session")
def server(tiny_models, tmp_path_factory):
    """One 2-stage server for this file and test_serve_hostile.py (which imports this fixture, so
    pytest holds two definitions: they share the process), under a low RLIMIT_NOFILE."""
    if _SHARED["server"] is None:
        _SHARED["server"] = start_server(
            tiny_models[2],
            2,
            tmp_path_factory.mktemp("serve"),
            lanes=4,
            timeout_s=30,
            nofile=NOFILE,
        )
    _SHARED["users"] += 1
    yield _SHARED["server"]
    _SHARED["users"] -= 1
    if not _SHARED["users"]:
        stop_server(_SHARED["server"])
        _SHARED["server"] = None


def client(server: Server, token: str = TOKEN):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)


def test_health_models_and_the_token(server):
    status, h = server.request("GET", "/health", token=None)
    assert status == 200 and h == {"status": "ok", "model": "s2"}  # liveness only, no details
    h = server.health()
    assert h["stages"] == 2 and [p["stage"] for p in h["pipeline"]] == [0, 1]
    assert all("pid" in p and "host" in p for p in h["pipeline"])
    assert client(server).models.list().data[0].id == "s2"
    assert server.request("GET", "/v1/models", token=None)[0] == 401
    assert server.request("GET", "/metrics", token="wrong")[0] == 401


def test_openai_client_greedy_matches_generate_and_streams(server, hf_reference):
    c = client(server)
    tok = hf_reference.tokenizer
    r = c.completions.create(model="s2", prompt=PROMPTS[0], max_tokens=9, temperature=0)
    want = tok.decode(hf_reference(PROMPTS[0], 9), skip_special_tokens=True)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == len(tok(PROMPTS[0])["input_ids"])
    chunks = list(
        c.completions.create(
            model="s2", prompt=PROMPTS[0], max_tokens=9, temperature=0, stream=True
        )
    )
    assert len(chunks) >= 2 and "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # every answer names the weights that produced it: the served model.safetensors' sha256
    manifest = json.loads((server.folder / "shards" / "manifest.json").read_text())
    h = server.health()
    assert h["weights"] == manifest["model_sha256"]
    assert h["system_fingerprint"] == "fp_" + manifest["model_sha256"][:16]
    assert r.system_fingerprint == h["system_fingerprint"]
    assert {ch.system_fingerprint for ch in chunks} == {h["system_fingerprint"]}
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    # a list of prompts: one choice each
    r = c.completions.create(model="s2", prompt=PROMPTS[:3], max_tokens=5, temperature=0)
    assert [ch.text for ch in r.choices] == [
        tok.decode(hf_reference(p, 5), skip_special_tokens=True) for p in PROMPTS[:3]
    ]


def test_seeded_sampling_is_reproducible_under_concurrency(server):
    c = client(server)

    def ask(seed):
        return (
            c.completions.create(
                model="s2",
                prompt=PROMPTS[1],
                max_tokens=12,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 40},
            )
            .choices[0]
            .text
        )

    first = ask(5)
    with ThreadPoolExecutor(6) as ex:  # more requests than lanes, all at once
        again = list(ex.map(ask, [5] * 6))
    assert again == [first] * 6
    assert {ask(s) for s in (6, 7, 8)} != {first}


def test_openai_fields_n_stop_echo_logprobs_user(server, hf_reference):
    c = client(server)
    tok = hf_reference.tokenizer
    greedy = tok.decode(hf_reference(PROMPTS[0], 12), skip_special_tokens=True)
    # n > 1, sampled: each choice is the same as its own request with seed + index
    r = c.completions.create(
        model="s2", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3, seed=21, user="someone"
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    alone = [
        c.completions.create(
            model="s2", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=21 + j
        )
        .choices[0]
        .text
        for j in range(3)
    ]
    assert [ch.text for ch in r.choices] == alone and len(set(alone)) > 1
    # n > 1 greedy, two prompts: every choice is the greedy one of its prompt
    r = c.completions.create(model="s2", prompt=PROMPTS[:2], max_tokens=12, temperature=0, n=2)
    assert [ch.text for ch in r.choices[:2]] == [greedy, greedy]
    # stop: cut before the first stop string, finish_reason stop (streamed too)
    stop = greedy[len(greedy) // 2 :][:3]
    assert stop.strip()
    r = c.completions.create(
        model="s2", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == greedy[: greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        c.completions.create(
            model="s2", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == greedy[: greedy.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # echo
    r = c.completions.create(model="s2", prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + greedy
    # logprobs: the chosen (greedy) token is the most likely of the top N
    r = c.completions.create(model="s2", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for word, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0 and max(top.values()) == pytest.approx(chosen)
        assert top[word] == pytest.approx(chosen)
    assert server.lanes_free()


def test_token_id_prompts_echo_and_prompt_logprobs_as_vllm(server, hf_reference):
    """lm-eval's log-likelihood request (token ids, echo, logprobs, max_tokens 0 or 1) against a
    single-process GPT2LMHeadModel, to 1e-4; the first prompt token's entries are null."""
    import torch
    from transformers import GPT2LMHeadModel

    tok = hf_reference.tokenizer
    model = GPT2LMHeadModel.from_pretrained(tiny_models_folder(server)).eval()
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
    for max_tokens in (0, 1):
        status, body = server.request(
            "POST",
            "/v1/completions",
            {
                "prompt": ids,
                "echo": True,
                "logprobs": 1,
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        assert status == 200, body
        for p, c in zip(ids, body["choices"]):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            want = lp[:-1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1).tolist()
            got = c["logprobs"]
            assert len(got["tokens"]) == len(p) + max_tokens
            assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
            assert got["token_logprobs"][1 : len(p)] == pytest.approx(want, abs=1e-4)
            for k in range(1, len(p)):
                ((word, best),) = got["top_logprobs"][k].items()
                assert word == tok.decode([int(lp[k - 1].argmax())])
                assert best == pytest.approx(float(lp[k - 1].max()), abs=1e-4)
            assert got["text_offset"][0] == 0 and c["text"].startswith(tok.decode(p))
            if max_tokens:
                assert got["token_logprobs"][-1] == pytest.approx(float(lp[-1].max()), abs=1e-4)
        assert body["usage"]["completion_tokens"] == 2 * max_tokens
    # echo without logprobs, max_tokens 0: the prompt alone
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": PROMPTS[0], "echo": True, "max_tokens": 0}
    )
    assert status == 200 and body["choices"][0]["text"] == PROMPTS[0], body
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["logprobs"] is None
    # streamed: the echoed prompt goes out with its log-probabilities
    status, text = server.request(
        "POST",
        "/v1/completions",
        {"prompt": ids[0], "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True},
    )
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == tok.decode(ids[0])
    assert len(first["logprobs"]["token_logprobs"]) == len(ids[0])
    lps = [e["choices"][0]["logprobs"] for e in events]
    assert sum(len(lp["tokens"]) for lp in lps if lp) == len(ids[0]) + 2


def tiny_models_folder(server: Server) -> Path:
    """The model folder the shared server's pipeline folder was cut from."""
    return Path(json.loads((server.folder / "distlm.json").read_text())["source_model"])


def test_concurrent_requests_each_get_their_own_answer(server, hf_reference):
    tok = hf_reference.tokenizer

    def ask(p):
        return server.request(
            "POST", "/v1/completions", {"prompt": p, "max_tokens": 7, "temperature": 0}
        )

    with ThreadPoolExecutor(4) as ex:  # 4 requests of one sequence each: within lanes + queue
        results = list(ex.map(ask, PROMPTS * 2))
    for p, (status, body) in zip(PROMPTS * 2, results):
        assert status == 200, body
        want = tok.decode(hf_reference(p, 7), skip_special_tokens=True)
        assert body["choices"][0]["text"] == want


def test_plain_http_stream(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps(
        {
            "prompt": PROMPTS[2],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn.request(
        "POST",
        "/v1/completions",
        body,
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6


BAD = [
    # (body, status, param, message fragment)
    ({"prompt": "", "max_tokens": 4}, 400, "prompt", "empty prompt"),
    ({"max_tokens": 4}, 400, "prompt", "prompt: required"),
    ({"prompt": [1, 400], "max_tokens": 4}, 400, "prompt", "token id 400 (position 1) is outside"),
    ({"prompt": [[3], [-1]], "max_tokens": 4}, 400, "prompt", "prompt[1]: token id -1"),
    ({"prompt": [1, "a"], "max_tokens": 4}, 400, "prompt", "holds integers only"),
    ({"prompt": [[1], "a"], "max_tokens": 4}, 400, "prompt", "prompt[1]: "),
    ({"prompt": [[1], []], "max_tokens": 4}, 400, "prompt", "prompt[1]: empty list of token ids"),
    ({"prompt": [True], "max_tokens": 4}, 400, "prompt", "a list of token ids"),
    ({"prompt": 5, "max_tokens": 4}, 400, "prompt", "expected a string, a non-empty list"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt", "non-empty list"),
    ({"prompt": [1] * 65, "max_tokens": 0, "echo": True, "logprobs": 1}, 400, "prompt", "never"),
    ({"prompt": "A class", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"prompt": "A class", "max_tokens": 0, "echo": False}, 400, "max_tokens", "only with echo"),
    ({"prompt": "A class", "max_tokens": -2}, 400, "max_tokens", "at least 1"),
    (
        {"prompt": "A class", "max_tokens": 100},
        400,
        "max_tokens",
        "beyond the model's context of 64",
    ),
    ({"prompt": "A class", "max_tokens": 30}, 400, "max_tokens", "above this server's limit of 20"),
    ({"prompt": "A class", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({"prompt": "A class", "max_tokens": True}, 400, "max_tokens", "valid integer"),
    ({"prompt": "A class", "temperature": -0.5}, 400, "temperature", "must be >= 0"),
    ({"prompt": "A class", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "A class", "top_p": 1.01}, 400, "top_p", "(0, 1]"),
    ({"prompt": "A class", "top_k": -1}, 400, "top_k", "must be >= 0"),
    ({"prompt": "A class", "seed": -1}, 400, "seed", "0..2**63-1"),
    ({"prompt": "A class", "seed": 2**64}, 400, "seed", "0..2**63-1"),
    ({"prompt": "A class", "logprobs": 21}, 400, "logprobs", "0..20"),
    ({"prompt": "A class", "n": 0}, 400, "n", "at least 1"),
    ({"prompt": "A class", "n": 9}, 400, "n", "at most 8"),
    ({"prompt": "A class", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"prompt": "A class", "suffix": "x"}, 400, "suffix", "not supported"),
    ({"prompt": "A class", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"prompt": "A class", "frequency_penalty": 1}, 400, "frequency_penalty", "not supported"),
    ({"prompt": "A class", "best_of": 2}, 400, "best_of", "not supported"),
    ({"prompt": "A class", "bogus": 1}, 400, "bogus", "unknown field"),
    ({"prompt": "A class", "stream": "yes"}, 400, "stream", "valid boolean"),
    ({"prompt": "A class", "user": 5}, 400, "user", "valid string"),
    (b"\xff\xfe{}", 400, None, "not valid UTF-8"),
    (b'{"prompt": "A class", ', 400, None, "not valid JSON"),
    (b'{"prompt": "A class", "temperature": NaN}', 400, None, "NaN is not a JSON number"),
    (b'{"prompt": "A class", "temperature": 1e999}', 400, None, "out of range"),
    (b"[1, 2]", 400, None, "expected a JSON object"),
    (b"", 400, None, "request body is empty"),
    (json.dumps({"prompt": "x" * 3000}).encode(), 413, None, "over the limit of 2048"),
]


@pytest.mark.parametrize(
    "body,status,param,fragment", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_requests_get_4xx_json_naming_the_field(server, body, status, param, fragment):
    got, err = server.request("POST", "/v1/completions", body)
    assert got == status, err
    assert fragment in err["error"]["message"] and err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error"


def test_chat_without_a_chat_template_is_a_400_naming_the_fix(server):
    """The shared server's folder has no chat template: a clear 400 that says how to add one,
    never a 500, and the server goes on (test_serve_chat.py serves a folder that has one)."""
    import openai

    chat = {"messages": [{"role": "user", "content": "A class"}], "max_tokens": 3}
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(server).chat.completions.create(model="s2", **chat)
    status, err = server.request("POST", "/v1/chat/completions", {**chat, "stream": True})
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == "messages"
    for fix in ("`chat_template`", "tokenizer_config.json", "/v1/completions"):
        assert fix in err["error"]["message"]
    assert server.request("POST", "/v1/chat/completions", chat, token=None)[0] == 401
    server.ok()


def test_auth_and_routes(server):
    import openai

    assert server.request("POST", "/v1/completions", {"prompt": "A"}, token=None)[0] == 401
    status, err = server.request("POST", "/v1/completions", {"prompt": "A"}, token="wrong")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").completions.create(model="s2", prompt="A", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client(server).completions.create(model="s2", prompt="A", max_tokens=2, top_p=2.0)
    status, err = server.request("GET", "/nope")
    assert status == 404 and "no route /nope" in err["error"]["message"]
    assert server.request("GET", "/v1/completions")[0] == 405


def test_long_prompt_truncated_and_said_so_then_still_serving(server):
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": "word " * 120, "max_tokens": 10}
    )
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["prompt_truncated_tokens"] > 0 and "dropped its first" in body["warnings"][0]
    assert body["usage"]["prompt_tokens"] == 64 - 10
    assert server.lanes_free()


def test_max_tokens_defaults_to_inference_max_new_tokens(server):
    """The serve stage declares inference.max_new_tokens; a request without max_tokens gets it
    (not OpenAI's 16), and a configured default above serve.max_tokens is refused at start."""
    from distlm.inference.server.supervisor import check_default_max_tokens

    status, body = server.request("POST", "/v1/completions", {"prompt": "A class"})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS, body
    assert body["choices"][0]["finish_reason"] == "length"
    check_default_max_tokens(20, 20)
    with pytest.raises(DistlmError, match="inference.max_new_tokens: 21, the default max_tokens"):
        check_default_max_tokens(21, 20)


def test_idle_stages_free_their_kv_cache(server):
    """A finished request's lanes free their KV cache on every stage: stage 0 at once, the others
    with the next message round the ring; /metrics shows each stage's cache bytes."""
    server.ok()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        cache = [m.get(f'distlm_stage_kv_cache_bytes{{stage="{s}"}}') for s in (0, 1)]
        if cache == [0, 0]:
            break
        time.sleep(0.2)
    assert cache == [0, 0], cache


def test_metrics_count_requests_tokens_and_latencies(server):
    before = server.metrics()
    server.ok()
    assert server.request("POST", "/v1/completions", {"prompt": ""})[0] == 400
    after = server.metrics()

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew('distlm_requests_total{route="/v1/completions",status="200"}') == 1
    assert grew('distlm_requests_total{route="/v1/completions",status="400"}') == 1
    assert grew("distlm_generation_tokens_total") == 3
    assert grew("distlm_time_to_first_token_seconds_count") == 1
    assert grew("distlm_inter_token_latency_seconds_count") == 2
    assert grew("distlm_e2e_request_latency_seconds_count") == 1
    assert grew('distlm_sequences_total{reason="length"}') == 1
    for name in (
        "distlm_queue_depth",
        "distlm_lanes_busy",
        "distlm_engine_up",
        'distlm_stage_compute_seconds{stage="0"}',
        'distlm_stage_wait_seconds{stage="1"}',
    ):
        assert name in after, name
    assert after["distlm_engine_up"] == 1
    assert after['distlm_stage_compute_seconds{stage="1"}'] > 0


@pytest.mark.slow  # its own server
def test_prompt_overflow_reject_and_a_clean_stop(tiny_models, tmp_path):
    s = start_server(tiny_models[2], 2, tmp_path, prompt_overflow="reject", timeout_s=30)
    try:
        status, err = s.request(
            "POST", "/v1/completions", {"prompt": "word " * 120, "max_tokens": 10}
        )
        assert status == 400 and "exceed the model's context of 64" in err["error"]["message"]
        assert err["error"]["param"] == "prompt"
        s.ok()
        # Ctrl-C on the API server: stage 0 stops the other stages through the ring, exit 0
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
        log = s.log.read_text()
        assert "engine stopped; per-stage time" in log and "pipeline stopped (exit code 0)" in log
        # every long-lived process froze its start-up heap out of garbage collection (distlm.runtime.heap)
        for who in ("API server", "stage 0", "stage 1"):
            assert re.search(rf"{who}: \d{{5,}} start-up objects frozen out of garbage", log), who
    finally:
        stop_server(s)


@pytest.mark.slow  # its own server
def test_hung_stage_gives_503_and_the_job_ends(tiny_models, tmp_path):
    s = start_server(tiny_models[2], 2, tmp_path, timeout_s=3)
    pid = s.health()["pipeline"][1]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # stage 1 stops answering (alive: the launcher sees nothing)
        status, err = s.request("POST", "/v1/completions", {"prompt": "A class", "max_tokens": 5})
        assert status == 503, err
        assert "no tokens back from the pipeline" in err["error"]["message"]
        assert s.proc.wait(timeout=60) != 0  # stage 0 aborts the job; the API server exits too
        assert "the pipeline is unavailable, answering 503" in s.log.read_text()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop_server(s)


@pytest.mark.slow  # its own server
def test_killed_stage_gives_503_and_a_nonzero_exit(tiny_models, tmp_path):
    # The launcher kills every rank when one is killed, stage 0 included: the API server answers.
    # timeout_s is long, so the 503 does not come from stage 0's deadline.
    s = start_server(tiny_models[3], 3, tmp_path, timeout_s=120)
    pid = s.health()["pipeline"][2]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # requests stay in flight until the stage dies
        body = {"prompt": "A class", "max_tokens": 5}
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(s.request, "POST", "/v1/completions", body)
            stream = pool.submit(s.request, "POST", "/v1/completions", {**body, "stream": True})
            deadline = time.monotonic() + 30
            while s.health()["lanes_busy"] < 2:
                assert time.monotonic() < deadline, "the requests never reached the pipeline"
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            status, err = plain.result()
            assert status == 503, err
            assert "the pipeline job ended (exit code" in err["error"]["message"]
            assert err["error"]["type"] == "service_unavailable"
            status, text = stream.result()  # the 200 went out with the stream's start
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            assert status == 200 and events[-1]["error"]["type"] == "service_unavailable", text
            assert "[DONE]" not in text
        assert s.proc.wait(timeout=60) != 0  # the API server exits with the job's exit code
    finally:
        stop_server(s)


def test_503_while_the_pipeline_starts_and_sigterm_stops_it(tiny_models, tmp_path):
    # a "launcher" that never starts a pipeline: the API server stays in its starting state
    s = start_server(
        tiny_models[2],
        2,
        tmp_path,
        wait=False,
        launcher=f"{sys.executable} -c 'import time; time.sleep(120)'",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, h = s.request("GET", "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and s.proc.poll() is None, s.log.read_text()
                time.sleep(0.2)
        assert status == 503 and h["status"] == "starting"
        status, err = s.request("POST", "/v1/completions", {"prompt": "A class"})
        assert status == 503 and err["error"]["type"] == "service_unavailable"
        assert "the pipeline is starting" in err["error"]["message"]
        s.proc.terminate()
        assert s.proc.wait(timeout=30) != 0  # the job was killed before it was ready
    finally:
        stop_server(s)


def test_exit_code_of_a_job_that_fails_to_start(tiny_models, tmp_path):
    s = start_server(
        tiny_models[2],
        2,
        tmp_path,
        wait=False,
        launcher=f"{sys.executable} -c 'import sys; sys.exit(3)'",
    )
    assert s.proc.wait(timeout=60) == 3
    assert "the pipeline job exited with code 3 before it was ready" in s.log.read_text()


def test_port_taken_and_token_sources_name_the_config_keys(tmp_path, monkeypatch):
    import socket

    from distlm import DistlmError
    from distlm.dag.config import validate_config
    from distlm.inference.server.supervisor import Supervisor, read_token
    from distlm.settings import EngineSettings, ServeSettings

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            DistlmError,
            match=rf"cannot listen on 127.0.0.1:{port} "
            r"\(serve.host/port\)",
        ):
            Supervisor(
                ServeSettings(port=port),
                EngineSettings(),
                launch=["true"],
                engine_args=[],
                api_args=[],
                model_dir=tmp_path,
                host="127.0.0.1",
                port=port,
                start_timeout_s=1,
            )
    base = ServeSettings()
    assert read_token(base) is None
    monkeypatch.delenv("DISTLM_NO_SUCH_VAR", raising=False)
    with pytest.raises(
        DistlmError, match="serve.token_env: environment variable DISTLM_NO_SUCH_VAR is not set"
    ):
        read_token(base.model_copy(update={"token_env": "DISTLM_NO_SUCH_VAR"}))
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    monkeypatch.setenv("DISTLM_T", "s3cret")
    assert read_token(base.model_copy(update={"token_file": str(f)})) == "s3cret"
    assert (
        read_token(base.model_copy(update={"token_file": str(f), "token_env": "DISTLM_T"}))
        == "s3cret"
    )
    monkeypatch.setenv("DISTLM_T", "other")
    with pytest.raises(DistlmError, match="hold different tokens"):
        read_token(base.model_copy(update={"token_file": str(f), "token_env": "DISTLM_T"}))
    with pytest.raises(DistlmError, match="serve.token_file: cannot read"):
        read_token(base.model_copy(update={"token_file": str(tmp_path / "missing")}))
    # the schema refuses a plain token value
    from distlm.dag.config import ConfigError

    with pytest.raises(ConfigError, match="serve.token: unknown key"):
        validate_config({"serve": {"token": "x"}})
    with pytest.raises(ConfigError, match="inference.serve: unknown key"):
        validate_config({"inference": {"serve": {}}})


def test_access_log_one_line_per_request_with_status_and_timings(server):
    server.ok()
    lines = [ln for ln in server.log.read_text().splitlines() if "distlm.inference.access" in ln]
    assert any(
        re.search(r"POST /v1/completions 200 \d+\.\d+s rid=\d+ tokens=3 ttft_s=", ln)
        for ln in lines
    )


def _processes() -> dict[int, tuple[int, str, bytes]]:
    """Every process: pid -> (parent pid, state, command line)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(entry.name)] = (int(stat[1]), stat[0], (entry / "cmdline").read_bytes())
        except OSError:
            continue
    return out


def _descendants(pid: int) -> set[int]:
    procs = _processes()
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, _) in procs.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie has ended)."""
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][1] != "Z"}


def _api_processes(supervisor_pid: int) -> list[int]:
    """The pids of the API server processes the supervisor started."""
    return sorted(
        pid
        for pid, (ppid, state, cmd) in _processes().items()
        if ppid == supervisor_pid and state != "Z" and b"\0--api\0" in cmd
    )


@pytest.mark.slow  # its own server
def test_two_api_server_processes_same_answers_summed_metrics_and_one_killed(
    tiny_models, tmp_path, hf_reference
):
    s = start_server(tiny_models[2], 2, tmp_path, serve={"api_servers": 2}, lanes=4, timeout_s=30)

    logged = s.logged

    try:
        for k in (1, 2):  # each process serves once stage 0 answered its channel, and says so
            logged(rf"api{k}.*API server process {k} \(start 1\) serving")
        tok = hf_reference.tokenizer
        want = [tok.decode(hf_reference(p, 6), skip_special_tokens=True) for p in PROMPTS[:4]]
        body = {"max_tokens": 6, "temperature": 0}

        def ask(i: int, stream: bool = False):
            status, doc = s.request(
                "POST", "/v1/completions", {**body, "prompt": PROMPTS[i % 4], "stream": stream}
            )
            assert status == 200, doc
            if not stream:
                return doc["choices"][0]["text"]
            return "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in doc.splitlines()
                if line.startswith("data: {")
            )

        before = s.metrics()
        with ThreadPoolExecutor(8) as pool:  # each request its own connection
            texts = list(pool.map(ask, range(24)))
            streamed = list(pool.map(lambda i: ask(i, True), range(8)))
        assert texts == [want[i % 4] for i in range(24)]
        assert streamed == [want[i % 4] for i in range(8)]
        route = 'distlm_requests_total{route="/v1/completions",status="200"}'
        tokens = "distlm_generation_tokens_total"

        def counted(want: dict[str, float]) -> dict[str, float]:
            """/metrics, from whichever process takes it, once its sums over both processes
            reach `want` (a request is counted as its answer goes out: a moment after the
            client has it)."""
            deadline = time.monotonic() + 10
            while True:
                now = s.metrics()
                grew = {k: now.get(k, 0) - before.get(k, 0) for k in want}
                if grew == want or time.monotonic() > deadline:
                    assert grew == want, grew
                    return now

        counted({route: 32, tokens: 32 * 6})

        log = s.log.read_text()
        assert all(re.search(rf"api{k}.*POST /v1/completions 200", log) for k in (1, 2))

        # the token, the limits and the field-naming 400s hold in whichever process answers
        # (a fresh connection each, 8 at a time: both processes take some)
        def hostile(_) -> None:
            assert s.request("POST", "/v1/completions", {"prompt": "x"}, token="wrong")[0] == 401
            status, err = s.request("POST", "/v1/completions", {"prompt": "x", "n": "two"})
            assert status == 400 and err["error"]["param"] == "n", err
            big = {"prompt": "x" * LIMITS["max_request_bytes"]}
            assert s.request("POST", "/v1/completions", big)[0] == 413
            assert s.request("GET", "/health", token=None)[1] == {"status": "ok", "model": "s2"}

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(hostile, range(16)))

        # one API process killed while requests run (stage 1 stopped holds them in the
        # pipeline): its clients lose their connections, the other's get their answers, the
        # supervisor starts it again, and stage 0 cancels what the dead one had open
        stage1 = s.health()["pipeline"][1]["pid"]
        pids = _api_processes(s.proc.pid)
        assert len(pids) == 2, pids

        def held(i: int) -> str | None:
            try:
                return ask(i)
            except OSError:  # its process was killed (connection reset or closed)
                return None

        os.kill(stage1, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(8) as pool:
                running = [pool.submit(held, i) for i in range(8)]
                deadline = time.monotonic() + 30
                while s.health()["lanes_busy"] < 4:
                    assert time.monotonic() < deadline, "the requests never reached the pipeline"
                    time.sleep(0.1)
                os.kill(pids[0], signal.SIGKILL)
                logged(r"API server process \d \(start 2\) serving")
                os.kill(stage1, signal.SIGCONT)
                got = [f.result(timeout=60) for f in running]
        finally:
            os.kill(stage1, signal.SIGCONT)
        assert all(g is None or g == want[i % 4] for i, g in enumerate(got)), got
        log = s.log.read_text()
        assert "died (exit code -9); starting it again" in log
        if None in got:  # the dead process had requests open: stage 0 cancelled them
            assert re.search(r"requests of its predecessor cancelled", log), log[-3000:]
        assert s.lanes_free()
        assert len(set(_api_processes(s.proc.pid)) - {pids[0]}) == 2
        assert [ask(i) for i in range(4)] == want
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, range(16))) == [want[i % 4] for i in range(16)]
        answered = sum(g is not None for g in got)
        counted({route: 32 + answered + 4 + 16})  # the dead process's counts stay in the sums
        assert s.lanes_free()
        # a stop ends both processes and the job; exit code 0
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
        assert _api_processes(s.proc.pid) == []
    finally:
        stop_server(s)


def test_more_api_servers_than_cores_is_refused_and_a_process_dying_over_and_over_ends_it(
    tmp_path,
):
    import socket

    from distlm.inference.server.supervisor import RESTARTS, ApiProcesses, Supervisor
    from distlm.settings import EngineSettings, ServeSettings

    cores = os.cpu_count() or 1
    with pytest.raises(DistlmError, match=rf"serve.api_servers: {cores + 1} .* at most {cores}"):
        Supervisor(
            ServeSettings(api_servers=cores + 1),
            EngineSettings(),
            launch=["true"],
            engine_args=[],
            api_args=[],
            model_dir=tmp_path,
            host="127.0.0.1",
            port=0,
            start_timeout_s=1,
        )
    # an API process that exits at once is started again, until it has died RESTARTS times
    with socket.create_server(("127.0.0.1", 0)) as sock:
        procs = ApiProcesses(1, [sys.executable, "-c", "raise SystemExit(3)"], sock, tmp_path)
        procs.start(0)
        reasons = []
        deadline = time.monotonic() + 60
        while not reasons:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            reason = procs.check()
            if reason is not None:
                reasons.append(reason)
        assert procs.starts == [RESTARTS]
        assert f"died {RESTARTS} times within 60 s (last exit code 3)" in reasons[0]


@pytest.mark.slow  # its own server
def test_a_killed_supervisor_leaves_no_process_behind(tiny_models, tmp_path):
    """SIGKILL to the supervisor alone (a lost terminal, an OOM kill): its API processes see
    their stdin close and exit, stage 0 sees its pid gone and stops the pipeline; nothing of the
    server keeps running."""
    s = start_server(tiny_models[2], 2, tmp_path, serve={"api_servers": 2}, lanes=4, timeout_s=30)
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(_api_processes(s.proc.pid)) < 2 or "(start 1) serving" not in s.log.read_text():
            assert time.monotonic() < deadline, s.log.read_text()[-3000:]
            time.sleep(0.2)
        s.ok()
        family = _descendants(s.proc.pid)
        ranks = {p for p, (_, _, cmd) in _processes().items() if p in family and b"--engine" in cmd}
        assert len(_api_processes(s.proc.pid)) == 2 and len(ranks) >= 2, family
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _alive(family):
            assert time.monotonic() < deadline, (_alive(family), s.log.read_text()[-3000:])
            time.sleep(0.2)
        log = s.log.read_text()
        assert "the API server's supervisor is gone" in log
        assert re.search(r"stopping \(the API server's supervisor \(pid \d+\) is gone\)", log)
    finally:
        for pid in _alive(family):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_server(s)

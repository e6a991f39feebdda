"""Live weight updates (POST /update_weights_from_disk): the folders they take and refuse, one
stage's staging, and a real server updated while clients use it: every answer from one set of
weights, greedy output equal to `generate` on the weights it names, all-or-nothing across stages,
the policies, and a stage killed mid-update."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_inference
import torch
from test_inference import PROMPTS
from test_server import TOKEN, start_server, stop_server

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.model import load_safetensors, read_meta, write_model_dir, write_pipeline_dir
from distlm.model.documents import CheckpointIndex
from distlm.model.folder import read_args
from distlm.model.weights import read_tensors, weight_files
from distlm.runtime.dist import free_port

tiny_models = test_inference.tiny_models
ROUTE = "/update_weights_from_disk"
PUSH = "/update_weights_from_distributed"


@pytest.fixture(scope="session")
def folders(tiny_models) -> dict[str, Path]:
    """The served weights A (`model`, and the pipeline folders cut from it), other weights B of
    the same architecture as a model folder (`other`) and a 2-stage pipeline folder (`other-s2`),
    A as a whole training checkpoint (`ckpt`), B's pipeline folder with stage 1's shard
    changed after it was written (`tampered`), and B with the final norm's weight of another
    shape (`misshapen`: its names and config are the model's)."""
    root = tiny_models[1].parent
    out = {
        "model": root / "model",
        "other": root / "other",
        "other-s2": root / "other-s2",
        "ckpt": root / "run" / "step-00000001",
        "tampered": root / "tampered-s2",
        "misshapen": root / "misshapen",
        "s2": tiny_models[2],
    }
    if out["tampered"].is_dir():
        return out
    sd = load_safetensors(out["model"] / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    other = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    meta = read_meta(out["model"]).model_dump()
    keep = ("created_by", "source", "config_digest", "data_config_digest", "dtype")
    write_model_dir(
        out["other"],
        state_dict=other,
        config_from=out["model"],
        tokenizer_dir=root / "tokenizer",
        meta={k: meta[k] for k in keep},
    )
    write_pipeline_dir(out["other"], out["other-s2"], stages=2)
    norm = next(k for k in other if k.endswith("ln_f.weight"))
    write_model_dir(
        out["misshapen"],
        state_dict={**other, norm: other[norm][: other[norm].shape[0] // 2]},
        config_from=out["model"],
        tokenizer_dir=root / "tokenizer",
        meta={k: meta[k] for k in keep},
    )
    out["ckpt"].mkdir(parents=True)
    shutil.copy(out["model"] / "model.safetensors", out["ckpt"] / "model.safetensors")
    write_document(
        out["ckpt"] / "checkpoint.json",
        CheckpointIndex(step=1, sha256={"model.safetensors": meta["model_sha256"]}),
    )
    shutil.copytree(out["other-s2"], out["tampered"])
    shard = out["tampered"] / "shards" / "stage-01.safetensors"
    data = bytearray(shard.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # same size, other bytes
    shard.write_bytes(bytes(data))
    return out


# ----------------------------------------------------------------------------- the folders


def test_the_three_folders_and_their_digests(folders):
    model, other = read_meta(folders["model"]), read_meta(folders["other"])
    assert weight_files(folders["model"]).digest == model.model_sha256
    assert weight_files(folders["ckpt"]).digest == model.model_sha256
    assert weight_files(folders["other-s2"]).digest == other.model_sha256 != model.model_sha256
    kinds = {weight_files(folders[k]).kind for k in ("model", "ckpt", "other-s2")}
    assert kinds == {"model folder", "training checkpoint", "pipeline folder"}
    src = weight_files(folders["other-s2"])
    names = set(src.tensors)
    manifest = json.loads((folders["other-s2"] / "shards" / "manifest.json").read_text())
    assert names == {t for s in manifest["shards"] for t in s["tensors"]}
    src.check_names(names, manifest["tied"])
    # one stage's tensors come from its own shard only, equal to what the folder holds
    stage1 = manifest["shards"][1]["tensors"]
    got = read_tensors(src, stage1, manifest["tied"])
    whole = load_safetensors(folders["other"] / "model.safetensors")
    for name in stage1:
        ref = whole.get(name, whole.get(manifest["tied"].get(name, "")))
        assert torch.equal(got[name], ref), name


def test_folders_refused_naming_the_file_or_the_tensor(folders, tmp_path):
    with pytest.raises(DistlmError, match="not an absolute path"):
        weight_files("results/train/final")
    with pytest.raises(DistlmError, match="no such folder"):
        weight_files(tmp_path / "nope")
    with pytest.raises(DistlmError, match="not a model folder.*pipeline folder.*checkpoint"):
        weight_files(tmp_path)
    # a sharded (fsdp) checkpoint: torch.distributed.checkpoint shards, named as such
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_document(
        sharded / "checkpoint.json", CheckpointIndex(step=2, sha256={"shards/__0_0.distcp": "0"})
    )
    with pytest.raises(DistlmError, match="sharded \\(fsdp\\).*final folder"):
        weight_files(sharded)
    # a truncated weights file: its header names bytes the file does not have
    cut = tmp_path / "cut"
    shutil.copytree(folders["model"], cut)
    f = cut / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(DistlmError, match="model.safetensors: tensor .* outside the file"):
        weight_files(cut)
    # a file changed after its document was written: refused when read, naming it
    src = weight_files(folders["tampered"])
    with pytest.raises(DistlmError, match="stage-01.safetensors: sha256 .* does not match"):
        read_tensors(src, list(src.tensors), {})
    # names: one missing, one of another model
    src = weight_files(folders["model"])
    names = set(src.tensors)
    with pytest.raises(DistlmError, match="tensor 'extra.weight' of the running model is missing"):
        src.check_names(names | {"extra.weight"}, {})
    some = min(names)
    with pytest.raises(DistlmError, match=f"tensor '{some}' is no part of the running model"):
        src.check_names(names - {some}, {})


def test_a_stage_stages_beside_its_weights_and_switches_in_place(folders):
    """One stage's staging (engine/update.py), without a server: a wrong shape is refused naming
    the tensor and leaves the weights as they were; the right ones, copied in, give the logits of
    a stage loaded afresh from them."""
    from distlm.inference.engine.pipeline_stage import Item, load_stage
    from distlm.inference.engine.ring import Prepare, Swap
    from distlm.inference.engine.update import NewWeights
    from distlm.inference.engine.weight_sources import FromDisk

    stage = load_stage(folders["s2"], 1, world=2)
    fresh = load_stage(folders["other-s2"], 1, world=2)
    tied = json.loads((folders["s2"] / "shards" / "manifest.json").read_text())["tied"]
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    x = torch.randn(5, stage.hidden_size)

    def logits(m):
        out = m([Item(0, 0, 0, 5)], x)
        m.release(0)
        return out

    bad = weight_files(folders["misshapen"])
    name = next(n for n in bad.tensors if n.endswith("ln_f.weight"))
    s = NewWeights(stage, Prepare(1, FromDisk(bad), tied, 2))
    while not s.done():
        time.sleep(0.01)
    assert s.word is not None and s.word.error is not None
    assert name in s.word.error and "shape" in s.word.error
    s.finish(Swap(1, commit=False))
    assert all(torch.equal(v, before[k]) for k, v in stage.state_dict().items())

    s = NewWeights(stage, Prepare(2, FromDisk(weight_files(folders["other-s2"])), tied, 2))
    while not s.done():
        time.sleep(0.01)
    assert s.word is not None and s.word.error is None and s.word.bytes > 0
    assert torch.equal(logits(stage), logits(load_stage(folders["s2"], 1, world=2)))
    s.finish(Swap(2, commit=True))
    assert torch.equal(logits(stage), logits(fresh))


def test_both_stages_stage_their_part_of_a_push(folders):
    """The stages' side of a push (engine/weight_sources.py's FromPush), without a server: each
    stage asks the sender for its own tensors and stages them; switched in, they give the logits
    of stages loaded afresh from the same weights."""
    from distlm.inference.engine.pipeline_stage import Item, load_stage
    from distlm.inference.engine.ring import Prepare, Swap
    from distlm.inference.engine.update import NewWeights
    from distlm.inference.engine.weight_sources import FromPush
    from distlm.settings import TransferSettings
    from distlm.transfer.push import PushSender

    tied = json.loads((folders["s2"] / "shards" / "manifest.json").read_text())["tied"]
    stages = [load_stage(folders["s2"], k, world=2) for k in (0, 1)]
    fresh = [load_stage(folders["other-s2"], k, world=2) for k in (0, 1)]
    x = torch.randn(5, stages[1].hidden_size)
    ids = torch.randint(0, 50, (5,))

    def logits(k: int, m):
        out = m([Item(0, 0, 0, 5)], ids if k == 0 else x)
        m.release(0)
        return out

    settings = TransferSettings(transport="torch", bucket_mb=0.05, chunk_mb=0.01, timeout_s=20)
    sender = PushSender.open(host="127.0.0.1", settings=settings)
    other = load_safetensors(folders["other"] / "model.safetensors")  # no tied copy: its source
    offer = sender.offer(read_meta(folders["other"]).model_sha256, "test", {})
    staging = [NewWeights(m, Prepare(7, FromPush(offer), tied, 2)) for m in stages]
    sent = sender.send(offer, other, done=lambda: False)
    assert sent is not None and sorted(sent) == [0, 1]
    for k, s in enumerate(staging):
        while not s.done():
            time.sleep(0.01)
        assert s.word is not None and s.word.error is None, s.word
        s.finish(Swap(7, commit=True))
        assert torch.equal(logits(k, stages[k]), logits(k, fresh[k]))


def test_who_may_update():
    from distlm.inference.server.errors import ApiError
    from distlm.inference.server.updates import loopback, may_update

    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("10.0.0.2") and not loopback("example.org")
    may_update(SimpleNamespace(token="t", serve=SimpleNamespace(host="0.0.0.0")))
    may_update(SimpleNamespace(token=None, serve=SimpleNamespace(host="127.0.0.1")))
    with pytest.raises(ApiError, match="need a bearer token") as e:
        may_update(SimpleNamespace(token=None, serve=SimpleNamespace(host="0.0.0.0")))
    assert e.value.status == 403


# ----------------------------------------------------------------------------- a real server


def _greedy(folder: Path, prompt: str, n: int) -> str:
    """`generate`'s greedy text on a folder's weights, loaded afresh."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _stream(server, body: dict, timeout: float = 60, started=None) -> list[dict]:
    """A streamed completion's chunks (its [DONE] checked); `started` is set at the first."""
    req = urllib.request.Request(
        server.base + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        for line in r:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            if line == b"data: [DONE]":
                return chunks
            chunks.append(json.loads(line[6:]))
            if started is not None:
                started.set()
    raise AssertionError("the stream ended without [DONE]")


def _abort_under_streams(server, other: Path, clients: int, old_fp: str, new_fp: str) -> int:
    """An update from `other` under policy abort while `clients` clients stream one greedy
    60-token request after another until it has answered (so that streams run at the switch,
    however long the update takes on a loaded machine): it answers 200, no stream fails, each
    has one set of weights, and each one it aborted ran on the old weights; how many it aborted."""
    streams: list = []
    started = [threading.Event() for _ in range(clients)]
    answered = threading.Event()
    errors: list = []

    def run(k: int) -> None:
        body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": 60, "temperature": 0}
        try:
            while not answered.is_set():
                streams.append(_stream(server, body, started=started[k]))
        except BaseException as e:  # a failed stream fails the test
            errors.append(e)
            started[k].set()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(timeout=60)
    status, b = server.request("POST", ROUTE, {"model_path": str(other), "policy": "abort"})
    answered.set()
    assert status == 200 and b["changed"], b
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    aborted = 0
    for chunks in streams:
        fps = {c["system_fingerprint"] for c in chunks}
        assert fps in ({old_fp}, {new_fp}), fps  # one set of weights a stream
        reason = [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1]
        if reason == "abort":
            assert fps == {old_fp}  # an aborted stream ran on the old weights
            aborted += 1
    return aborted


@pytest.mark.slow
@pytest.mark.with_slurm
def test_updates_under_load_one_set_of_weights_an_answer(folders, tmp_path):
    """16 clients, greedy, streamed and not, while the 2-stage server takes 5 updates (model
    folder, pipeline folder, training checkpoint, with both policies) and two that fail on
    stage 1 alone (a file changed, a tensor of another shape): no request fails, every answer (every chunk of a stream) names one set of
    weights, and its tokens are `generate`'s on the weights it names."""
    model, other = read_meta(folders["model"]), read_meta(folders["other"])
    fp = {"fp_" + model.model_sha256[:16]: "model", "fp_" + other.model_sha256[:16]: "other"}
    n = 12
    prompts = PROMPTS[:4]
    ref = {(w, p): _greedy(folders[w], p, n) for w in ("model", "other") for p in prompts}
    server = start_server(
        folders["s2"], 2, tmp_path, serve={"max_queued_sequences": 64, "max_tokens": n}
    )
    stop = threading.Event()
    answers: list[tuple[str, str, str, str]] = []
    failures: list[str] = []

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = prompts[(k + i) % len(prompts)]
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
            try:
                if (k + i) % 2:
                    chunks = _stream(server, body)
                    fps = {c["system_fingerprint"] for c in chunks}
                    if len(fps) != 1:
                        failures.append(f"a stream named {fps}")
                        continue
                    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
                    reason = [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1]
                    answers.append((fps.pop(), prompt, text, reason))
                else:
                    status, b = server.request("POST", "/v1/completions", body)
                    if status != 200:
                        failures.append(f"{status}: {b}")
                        continue
                    ch = b["choices"][0]
                    answers.append(
                        (b["system_fingerprint"], prompt, ch["text"], ch["finish_reason"])
                    )
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        steps = [  # (folder, policy, the weights served after it: None, refused)
            ("tampered", "wait", None),  # stage 0 stages, stage 1's file is refused: no switch
            ("other", "wait", "other"),
            ("ckpt", "abort", "model"),
            ("misshapen", "abort", None),  # stage 1's norm of another shape: no switch
            ("other-s2", "wait", "other"),
            ("model", "abort", "model"),
            ("other", "wait", "other"),
        ]
        served = "model"
        for source, policy, then in steps:
            status, b = server.request(
                "POST", ROUTE, {"model_path": str(folders[source]), "policy": policy}
            )
            if then is None:
                assert status == 400 and not b["success"] and not b["changed"], b
                assert "stage 1" in b["message"] or "stage-01" in b["message"], b
                assert "unchanged" in b["message"], b
                assert b["stall"] == {"held_s": 0.0, "switch_s": 0.0}, b  # nothing was held
            else:
                assert status == 200 and b["success"] and b["changed"], b
                stall = b["stall"]  # new requests held; every token stopped, the ring's round
                assert 0 < stall["held_s"] < b["seconds"] and 0 < stall["switch_s"] < b["seconds"]
                served = then
            assert fp[b["system_fingerprint"]] == served
            time.sleep(0.7)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    try:
        assert not failures, failures[:5]
        assert len(answers) > 100
        named = {fp[f] for f, *_ in answers}
        assert named == {"model", "other"}
        reasons = {r for *_, r in answers}
        assert "abort" in reasons and reasons <= {"abort", "length", "stop"}, reasons
        for f, prompt, text, reason in answers:
            w = fp[f]
            if reason == "abort":  # ended by an update: what it has begins its weights' text
                assert ref[w, prompt].startswith(text), (w, prompt, text)
            else:
                assert text == ref[w, prompt], (w, prompt, text)
        h = server.health()
        assert h["system_fingerprint"] == "fp_" + other.model_sha256[:16]
        assert h["last_update"]["source"] == str(folders["other"])
        assert h["last_update"]["bytes"] > 0 and h["last_update"]["stall"]["switch_s"] > 0
        m = server.metrics()
        assert m['distlm_weight_updates_total{outcome="switched"}'] == 5
        assert m['distlm_weight_updates_total{outcome="failed"}'] == 2
        assert m["distlm_weight_update_seconds_count"] == 5
    finally:
        stop_server(server)


@pytest.mark.slow
@pytest.mark.with_slurm
def test_hostile_update_requests_and_a_stage_killed_mid_update(folders, tmp_path):
    """Bad bodies get a 4xx naming the field; no token, 401. Then a stage killed while an update
    waits for a stream to end: every open request and the update get 503, the job ends, and a
    server started again serves its own weights, never a mix."""
    model = read_meta(folders["model"])
    server = start_server(folders["s2"], 2, tmp_path, serve={"max_tokens": 50})
    try:
        for body, status, fragment in [
            (b"{", 400, "not valid JSON"),
            ({"model_path": "/x", "policy": "keep"}, 400, "policy"),
            ({"model_path": "/x", "extra": 1}, 400, "extra: unknown field"),
            ({"policy": "wait"}, 400, "model_path: required"),
            ({"model_path": 7}, 400, "model_path"),
            ({"model_path": "relative/path"}, 400, "not an absolute path"),
            ({"model_path": str(folders["model"] / "config.json")}, 400, "no such folder"),
            (b"x" * 5000, 413, "serve.max_request_bytes"),
        ]:
            got, b = server.request("POST", ROUTE, body)
            assert got == status, (body, b)
            text = json.dumps(b)
            assert fragment in text, (fragment, b)
        assert server.request("POST", ROUTE, {"model_path": "/x"}, token=None)[0] == 401
        # the push route's offer (distlm.transfer.documents.PushOffer), field by field
        offer = {"host": "127.0.0.1", "port": free_port(), "group": "a1b2c3d4e5f6a7b8"}
        offer |= {"key": "5a" * 32}
        arch = read_args(folders["model"]).signature()
        offer |= {"digest": "ab" * 32, "timeout_s": 3, "architecture": arch}
        for body, fragment in [
            ({k: v for k, v in offer.items() if k != "port"}, "port: required"),
            ({**offer, "port": 0}, "port"),
            ({**offer, "host": "a b"}, "host"),
            ({**offer, "group": "../../x"}, "group"),
            ({**offer, "digest": "xyz"}, "digest"),
            ({k: v for k, v in offer.items() if k != "key"}, "key: required"),
            ({**offer, "key": "ab" * 8}, "key"),
            ({**offer, "backend": "nccl"}, "backend: unknown field"),
            ({**offer, "transport": "nccl"}, "transport"),
            ({**offer, "device": {"gpu": "../x"}}, "device.gpu"),
            ({**offer, "device": {"type": "cuda"}}, "device.type: unknown field"),
            ({**offer, "timeout_s": 1e9}, "timeout_s"),
            ({**offer, "policy": "retract"}, "policy"),
            ({**offer, "names": []}, "names: unknown field"),
            (
                {**offer, "architecture": {**arch, "n_layer": 99}},
                "another architecture: n_layer 99",
            ),
        ]:
            got, b = server.request("POST", PUSH, body)
            assert got == 400 and fragment in json.dumps(b), (body, b)
        assert server.request("POST", PUSH, offer, token=None)[0] == 401
        # a sender that is not there: every stage fails to reach its store, nothing changes
        got, b = server.request("POST", PUSH, offer)
        assert got == 400 and not b["success"] and not b["changed"], b
        assert "the sender's store does not answer" in b["message"], b
        assert b["weights"] == model.model_sha256
        server.ok()

        # a stage killed while the update drains (policy wait, a long stream running)
        got: dict = {}

        def long_stream() -> None:
            try:
                got["chunks"] = _stream(
                    server, {"prompt": PROMPTS[0], "max_tokens": 50, "temperature": 0}
                )
            except Exception as e:
                got["error"] = e

        t = threading.Thread(target=long_stream)
        t.start()
        stage1 = _stage_pid(server, 1)
        update: dict = {}

        def run_update() -> None:
            update["answer"] = server.request(
                "POST", ROUTE, {"model_path": str(folders["other"]), "policy": "wait"}
            )

        u = threading.Thread(target=run_update)
        u.start()
        time.sleep(0.05)
        os.kill(stage1, signal.SIGKILL)
        u.join(timeout=120)
        t.join(timeout=120)
        status, b = update["answer"]
        assert status in (200, 503), b  # the update may have switched before the kill
        server.proc.wait(timeout=120)
        assert server.proc.returncode != 0
    finally:
        stop_server(server)
    again = start_server(folders["s2"], 2, tmp_path / "again")
    try:
        assert again.health()["system_fingerprint"] == "fp_" + model.model_sha256[:16]
        again.ok()
    finally:
        stop_server(again)


@pytest.mark.slow
@pytest.mark.with_slurm
def test_abort_on_one_stage_ends_the_running_requests_and_serves_on(folders, tiny_models, tmp_path):
    """Policy abort on a one-stage server (stage 0 is also the last: the running sequences end
    at once, not when their tokens come back): each running stream ends, 200, finish reason
    abort, on the old weights; the server serves the new ones. Each client streams one request
    after another until the update has answered, so that streams run when the switch comes
    however long the update takes on a loaded machine (a stream of 60 tokens may end first)."""
    model, other = read_meta(folders["model"]), read_meta(folders["other"])
    old_fp, new_fp = "fp_" + model.model_sha256[:16], "fp_" + other.model_sha256[:16]
    server = start_server(tiny_models[1], 1, tmp_path, serve={"max_tokens": 60})
    try:
        aborted = _abort_under_streams(server, folders["other"], 8, old_fp, new_fp)
        assert aborted, "no stream ended with finish reason abort"
        status, b = server.request("POST", "/v1/completions", {"prompt": "A", "max_tokens": 3})
        assert status == 200 and b["system_fingerprint"] == new_fp
    finally:
        stop_server(server)


@pytest.mark.slow
@pytest.mark.with_slurm
def test_a_server_with_two_steps_in_flight_answers_as_one_step_at_a_time(
    folders, tiny_models, tmp_path
):
    """inference.steps_in_flight 2 on a one-stage server, through the serve command: its log
    says so; 12 clients at once, streamed and not, each get `generate`'s greedy text; a stream
    whose client goes away mid-way ends and the others go on; an update with policy abort ends
    the running streams on the old weights, and then every answer is `generate`'s text on the
    new ones."""
    import http.client

    model, other = read_meta(folders["model"]), read_meta(folders["other"])
    old_fp, new_fp = "fp_" + model.model_sha256[:16], "fp_" + other.model_sha256[:16]
    server = start_server(
        tiny_models[1],
        1,
        tmp_path,
        serve={"max_tokens": 60, "max_queued_sequences": 16},
        lanes=8,
        steps_in_flight=2,
    )
    try:
        server.logged(r"micro-batches of at most 4 sequences, 2 in flight at once")
        want = {p: _greedy(folders["model"], p, 12) for p in PROMPTS}
        body = {"max_tokens": 12, "temperature": 0}

        def ask(k: int) -> tuple[str, str]:
            prompt = PROMPTS[k % len(PROMPTS)]
            if k % 2:
                chunks = _stream(server, {**body, "prompt": prompt})
                return prompt, "".join(ch["text"] for c in chunks for ch in c["choices"])
            status, b = server.request("POST", "/v1/completions", {**body, "prompt": prompt})
            assert status == 200, b
            return prompt, b["choices"][0]["text"]

        # a client that goes away after its first chunks
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": PROMPTS[0], "max_tokens": 60, "stream": True}),
            {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        with ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(ask, range(12)))
            conn.close()
        for prompt, text in answers:
            assert text == want[prompt], prompt
        # policy abort while streams run: they end on the old weights, then the new ones serve
        assert _abort_under_streams(server, folders["other"], 4, old_fp, new_fp)
        for prompt in PROMPTS[:3]:
            status, b = server.request("POST", "/v1/completions", {**body, "prompt": prompt})
            assert status == 200 and b["system_fingerprint"] == new_fp, b
            assert b["choices"][0]["text"] == _greedy(folders["other"], prompt, 12)
    finally:
        stop_server(server)


@pytest.mark.slow
@pytest.mark.with_slurm
def test_two_api_processes_hear_the_new_weights(folders, tmp_path):
    """serve.api_servers 2: an update asked of one process reaches both (stage 0 tells every
    channel): after it, each process alone (the other stopped, so that it takes every
    connection) answers with the new weights' fingerprint and `generate`'s text on them; a
    process killed and started again hears the weights served now."""

    from test_server import _api_processes

    other = read_meta(folders["other"])
    new = "fp_" + other.model_sha256[:16]
    want = _greedy(folders["other"], PROMPTS[0], 6)
    server = start_server(folders["s2"], 2, tmp_path, serve={"api_servers": 2})
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}

    def ask() -> tuple[str, str]:
        status, b = server.request("POST", "/v1/completions", body)
        assert status == 200, b
        return b["system_fingerprint"], b["choices"][0]["text"]

    def each_alone() -> None:
        pids = _api_processes(server.proc.pid)
        assert len(pids) == 2, pids
        for alone in pids:
            others = [p for p in pids if p != alone]
            for p in others:
                os.kill(p, signal.SIGSTOP)
            try:
                got = {ask() for _ in range(3)}
            finally:
                for p in others:
                    os.kill(p, signal.SIGCONT)
            assert got == {(new, want)}, (alone, got)

    logged = server.logged

    try:
        for k in (1, 2):  # both attached (stage 0 answered them) before the update
            logged(rf"api{k}.*API server process {k} \(start 1\) serving")
        status, b = server.request(
            "POST", ROUTE, {"model_path": str(folders["other"]), "policy": "wait"}
        )
        assert status == 200 and b["changed"], b
        each_alone()
        # a process killed and started again attaches, and stage 0's Ready names the weights
        os.kill(_api_processes(server.proc.pid)[0], signal.SIGKILL)
        logged(r"API server process \d \(start 2\) serving")
        each_alone()
    finally:
        stop_server(server)


def _stage_pid(server, stage: int) -> int:
    for info in server.health()["pipeline"]:
        if info["stage"] == stage:
            return int(info["pid"])
    raise AssertionError(f"no stage {stage} in /health")

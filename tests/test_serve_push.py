"""Serve while training (docs/serving.md), as a user runs it: `snakemake serve` with
serve.model base and serve.follow_training takes each checkpoint the training run pushes
(distlm.train.pushes -> POST /update_weights_from_distributed -> each stage fetches its own part
through distlm.transfer.push); the push's parts, one stage at a time; a trainer killed mid-push."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY, copy_workflow, run_snakemake, snakemake_cmd
from harness.faults import fault_env, paced_env
from test_serve_updates import _greedy

from distlm.core.documents import encode
from distlm.core.io import sha256_file
from distlm.inference.messages import fingerprint
from distlm.model import load_safetensors, read_meta, write_model_dir
from distlm.runtime.dist import free_port
from distlm.settings import TransferSettings
from distlm.train.pushes import reachable_host
from distlm.transfer.chain import broadcast_state_dict
from distlm.transfer.documents import PushDevice, PushWant
from distlm.transfer.errors import TransferError
from distlm.transfer.peers import Peers
from distlm.transfer.push import (
    PushSender,
    part_digest,
    receive,
    route_for,
    seal,
    store_key,
)

TOKEN_ENV, TOKEN = "DISTLM_TEST_PUSH_TOKEN", "push-secret"


# ----------------------------------------------------------------------------- the parts


def _want(tensors: dict, stage: int, stages: int) -> PushWant:
    return PushWant.of(
        tensors, stage=stage, stages=stages, tied={"lm_head": "wte"}, device=torch.device("cpu")
    )


def _gpus(n: int) -> list:
    """Marks of a case that needs `n` CUDA GPUs (gpu: benchmarks/gpu/run.sh runs it)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [pytest.mark.gpu, pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs")]


# (the sender's device, the stages' device, the route each stage's part takes)
PLACEMENTS = [
    pytest.param("cpu", "cpu", "gloo", id="host"),
    # a trainer and a server on a workstation's one GPU: NCCL refuses two ranks on one GPU
    pytest.param("cuda:0", "cuda:0", "gloo", id="one-gpu", marks=_gpus(1)),
    pytest.param("cuda:0", "cuda:1", "nccl", id="two-gpus", marks=_gpus(2)),
]


@pytest.mark.parametrize("sender_on,stages_on,backend", PLACEMENTS)
def test_each_stage_gets_its_own_part_in_its_dtype_and_a_tied_copy_from_its_source(
    sender_on, stages_on, backend
):
    """Each stage gets exactly its part, in its dtype, a tied copy from its source, on the route
    its device and the sender's give: GPU to GPU (NCCL) between two GPUs, through host memory
    otherwise, where the stage copies it to its device."""
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=20)
    g = torch.Generator().manual_seed(0)
    full = {
        n: torch.randn(s, generator=g)
        for n, s in {"wte": (64, 16), "h.0": (16, 16), "h.1": (16, 48), "ln_f": (16,)}.items()
    }
    stage_device = torch.device(stages_on)
    mine = [
        {"wte": full["wte"].bfloat16(), "h.0": full["h.0"]},
        {"h.1": full["h.1"], "ln_f": full["ln_f"], "lm_head": full["wte"]},
    ]
    wants = [
        PushWant.of(
            {n: t.to(stage_device) for n, t in m.items()},
            stage=k,
            stages=2,
            tied={"lm_head": "wte"},
            device=stage_device,
        )
        for k, m in enumerate(mine)
    ]
    sender = PushSender.open(host="127.0.0.1", settings=st, device=torch.device(sender_on))
    offer = sender.offer("ab" * 32, "step 3", {})
    assert offer.transport == "torch" and (offer.device.gpu is None) == (sender_on == "cpu")
    got: dict[int, object] = {}
    errors: list = []

    def stage(k: int) -> None:
        try:
            got[k] = receive(offer, wants[k], stage_device)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(k,)) for k in (1, 0)]  # any order
    for t in threads:
        t.start()
    sent = sender.send(offer, full, done=lambda: False)
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(sent) == {0, 1} and all(r.stats.all_verified for r in sent.values())
    assert {r.stats.backend for r in sent.values()} == {backend}
    assert {got[k].stats.backend for k in got} == {backend}
    landed = stage_device if backend == "nccl" else torch.device("cpu")
    assert {t.device for k in got for t in got[k].tensors.values()} == {landed}
    assert set(got[0].tensors) == {"wte", "h.0"} and set(got[1].tensors) == {
        "h.1",
        "ln_f",
        "lm_head",
    }
    assert got[0].tensors["wte"].dtype == torch.bfloat16
    assert torch.equal(got[0].tensors["wte"].cpu(), full["wte"].bfloat16())
    # the tied copy, from its source
    assert torch.equal(got[1].tensors["lm_head"].cpu(), full["wte"])
    assert sent[0].stats.bytes < sum(t.numel() * 4 for t in full.values())  # its part alone


def test_each_stage_parts_route_follows_from_the_two_devices():
    """`route_for`: NCCL between two GPUs; host memory when a side is on the host or both are
    the one GPU; uccl refuses a side on the host, naming transfer.transport; an ask naming a GPU
    by anything but a UUID is refused; a group of its own over NCCL without one says so."""
    host, a, b = PushDevice(), PushDevice(gpu="GPU-aaaa-1"), PushDevice(gpu="GPU-bbbb-2")
    for sender, stage, backend in [
        (host, host, "gloo"),
        (host, a, "gloo"),
        (a, host, "gloo"),
        (a, a, "gloo"),  # NCCL refuses two ranks on one GPU
        (a, b, "nccl"),
    ]:
        route = route_for(sender, stage, "torch", "push")
        assert route.backend == backend and route.transport == "torch", (sender, stage)
        assert route.on_gpu == (backend == "nccl")
    assert route_for(a, a, "uccl", "push") == route_for(a, b, "uccl", "push")
    assert route_for(a, b, "uccl", "push").on_gpu
    for sender, stage, side in [(host, a, "the sender"), (a, host, "the stage")]:
        with pytest.raises(TransferError, match=f"transfer.transport uccl.*{side}"):
            route_for(sender, stage, "uccl", "push")
    with pytest.raises(Exception, match="gpu"):
        PushDevice.model_validate({"gpu": "../../x"})
    if not torch.cuda.is_available():
        store = torch.distributed.HashStore()
        with pytest.raises(TransferError, match="over nccl.*no NCCL or sees no GPU"):
            Peers.own(store, 0, 2, "nccl", 5)


def test_a_stage_that_wants_another_shape_or_a_name_the_sender_lacks_is_refused_naming_it():
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=10)
    full = {"wte": torch.zeros(8, 4), "h.0": torch.zeros(4, 4)}
    for want, match in (
        (_want({"wte": torch.zeros(8, 4), "h.0": torch.zeros(4, 5)}, 0, 1), "'h.0' has shape"),
        (_want({"wte": torch.zeros(8, 4), "h.9": torch.zeros(4, 4)}, 0, 1), "'h.9'.*lacks"),
    ):
        sender = PushSender.open(host="127.0.0.1", settings=st)
        offer = sender.offer("cd" * 32, "bad", {})
        errors: list[Exception] = []

        def stage(want=want, errors=errors, offer=offer) -> None:
            try:
                receive(offer, want)
            except TransferError as e:
                errors.append(e)

        t = threading.Thread(target=stage)
        t.start()
        with pytest.raises(TransferError, match=match):
            sender.send(offer, full, done=lambda: False)
        t.join(5)  # the stage hears the refusal at once: it never waits for a group
        assert not t.is_alive() and errors, "the stage must not wait for a part that never comes"
        assert re.search("the sender refused: .*" + match, str(errors[0])), errors[0]
        del sender


def test_a_stage_whose_sender_is_gone_fails_at_once_naming_the_push():
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=5)
    sender = PushSender.open(host="127.0.0.1", settings=st)
    offer = sender.offer("ef" * 32, "step 9", {})
    port = offer.port
    del sender  # its store goes: nothing listens on the port any more
    offer = offer.model_copy(update={"port": port})
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="push step 9 from 127.0.0.1.*does not answer"):
        receive(offer, _want({"wte": torch.zeros(2, 2)}, 0, 1))
    assert time.monotonic() - t0 < 2  # at once, not after the offer's timeout_s (5 s)


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":  # 0A: LISTEN
                out.append(address)
    return out


def test_the_push_store_listens_on_the_address_the_stages_reach_alone():
    """torch's TCPStore would listen on every interface; anyone who reaches it may list and write
    its keys. A push's store listens on the one address its offer names (here loopback), and
    the address the trainer offers is its own on the route to the server, never the host's name
    (Debian maps that to 127.0.1.1)."""
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=5)
    sender = PushSender.open(host="127.0.0.1", settings=st)
    offer = sender.offer("ab" * 32, "step 1", {})
    assert _listening(offer.port) == ["0100007F"]  # 127.0.0.1, no 0.0.0.0, no ::
    assert "key" not in repr(offer) and offer.key not in repr(offer)
    assert reachable_host("http://127.0.0.1:8000") == "127.0.0.1"
    assert reachable_host("http://localhost:8000") in ("127.0.0.1", "::1")
    ip = socket.gethostbyname(socket.gethostname())
    if not ip.startswith("127."):  # a host with an address other hosts reach
        assert reachable_host(f"http://{ip}:8000") == ip


def test_an_ask_not_sealed_with_the_offers_key_gets_nothing():
    """A process that reaches the sender's store without the offer (the store has no
    authentication; its keys can be listed) writes an ask of its own: the sender sends nothing
    to it and names it."""
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=5)
    sender = PushSender.open(host="127.0.0.1", settings=st)
    offer = sender.offer("ab" * 32, "step 2", {})
    intruder = torch.distributed.TCPStore("127.0.0.1", offer.port, is_master=False)
    key = store_key(offer, "want", "0")  # the group's name is no secret: list_keys
    forged = offer.model_copy(update={"key": "0" * 64})
    intruder.set(key, seal(forged.key, encode(_want({"wte": torch.zeros(8, 4)}, 0, 1))))
    with pytest.raises(TransferError, match="stage 0's ask is not sealed with the offer's key"):
        sender.send(offer, {"wte": torch.ones(8, 4)}, done=lambda: False)
    answer = intruder.get(store_key(offer, "answer", "0")).decode()
    assert answer.startswith("refused: stage 0's ask is not sealed"), answer
    assert not [k for k in intruder.list_keys() if "/pair/" in k]  # no group was ever made


def test_a_part_not_sealed_with_the_offers_key_is_not_used():
    """A process that reaches the store and answers a stage's ask itself (it read the ask, but
    has not the key): the bytes arrive whole, their checksums hold, and the stage still refuses
    them, since their keyed digest is not the sender's."""
    st = TransferSettings(transport="torch", bucket_mb=0.01, chunk_mb=0.002, timeout_s=10)
    sender = PushSender.open(host="127.0.0.1", settings=st)
    offer = sender.offer("ab" * 32, "step 3", {})
    impostor = offer.model_copy(update={"key": "1" * 64})  # what the impostor seals with
    want = _want({"wte": torch.zeros(8, 4)}, 0, 1)
    theirs = {"wte": torch.full((8, 4), 7.0)}

    def answer() -> None:  # the impostor's side: what PushSender.send does, with its own key
        store = torch.distributed.TCPStore("127.0.0.1", offer.port, is_master=False)
        store.wait([store_key(offer, "want", "0")])
        store.set(store_key(offer, "answer", "0"), "go")
        pair = torch.distributed.PrefixStore(store_key(offer, "pair", "0") + "/", store)
        peers = Peers.own(pair, 0, 2, "gloo", 10)
        try:
            broadcast_state_dict(theirs, settings=offer.settings(), peers=peers)
        finally:
            peers.close()
        store.set(store_key(offer, "sealed", "0"), part_digest(impostor.key, theirs))

    t = threading.Thread(target=answer)
    t.start()
    with pytest.raises(TransferError, match="not sealed with the offer's key.*not used"):
        receive(offer, want)
    t.join(30)
    # the sender's own seal is what the stage expects: the same part under the offer's key
    assert part_digest(offer.key, theirs) != part_digest(impostor.key, theirs)


# ----------------------------------------------------------------------------- the workflow


def _get(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _complete(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:300]}


def _planned(dry: subprocess.CompletedProcess) -> dict[str, int]:
    """The jobs a dry run plans: {rule: count}."""
    out = dry.stdout + dry.stderr
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:")[1].split("Reasons:")[0]
    rows = [line.split() for line in table.splitlines()[3:] if line.strip()]
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and r[1].isdigit()}


def _folders_by_fingerprint(work: Path) -> dict[str, Path]:
    """Every set of weights the server may have served: the base model and every checkpoint of
    the training runs (a model folder made of each, to load with transformers)."""
    base = work / "results/model/base"
    meta = read_meta(base)
    out = {fingerprint(meta.model_sha256): base}
    keep = ("created_by", "source", "config_digest", "data_config_digest", "dtype")
    for index in glob.glob(str(work / "results/train/checkpoints/*/step-*/checkpoint.json")):
        ckpt = Path(index).parent
        digest = json.loads(Path(index).read_text())["sha256"]["model.safetensors"]
        folder = work / "ckpt-models" / f"{ckpt.parent.name}-{ckpt.name}"
        write_model_dir(
            folder,
            state_dict=load_safetensors(ckpt / "model.safetensors"),
            config_from=base,
            tokenizer_dir=work / "results/data/tokenizer",
            meta={k: meta.model_dump()[k] for k in keep},
        )
        out[fingerprint(digest)] = folder
    return out


@pytest.mark.slow
def test_serve_while_training_takes_each_push_and_a_trainer_killed_mid_push_changes_nothing(
    workflow_run, tmp_path
):
    """docs/serving.md's commands: `snakemake serve` (serve.model base, follow_training, a token)
    comes up, reruns nothing of the finished workflow, and says where it listens; `snakemake
    train` (a new run) pushes each checkpoint; its rank 0 is killed in the middle of step 4's push
    (stage 0 has its part, stage 1's is unsent) and torchrun restarts the job, which resumes from
    step 4's checkpoint and pushes on. 8 clients meanwhile: no request fails, every answer names
    one set of weights and is `generate`'s greedy text on them, the failed push leaves the old
    weights serving, and the server ends on the final step's weights, named by the digest of that
    checkpoint's model.safetensors."""
    work = copy_workflow(workflow_run, tmp_path / "work")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_yaml = tmp_path / "serve.yaml"
    serve = {"port": port, "stages": 2, "model": "base", "follow_training": True}
    serve_yaml.write_text(yaml.safe_dump({"serve": {**serve, "token_env": TOKEN_ENV}}))
    train_yaml = tmp_path / "train.yaml"
    train = {"max_steps": 8, "ckpt_every": 2, "lr": 0.003, "max_restarts": 1, "keep_last": 10}
    train_yaml.write_text(yaml.safe_dump({"train": train}))
    env = {**os.environ, TOKEN_ENV: TOKEN}

    # following the training run is no edit of a finished job: the main job plans what it plans
    # without it (the copy's inference job reads the checkout's prompts by a path relative to
    # it, which the copy changed: test_kill_workflow.py)
    plans = [
        _planned(run_snakemake(work, "-n", configfiles=files))
        for files in ((TINY,), (TINY, serve_yaml))
    ]
    assert plans[0] == plans[1] and "train" not in plans[1], plans

    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            snakemake_cmd(work, "serve", "--nolock", configfiles=(TINY, serve_yaml)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    endpoint = work / "results/serve/endpoint.json"
    stop = threading.Event()
    answers: list[tuple[str, str, str]] = []
    failures: list[str] = []
    prompts = ["The", "In the year", "Music is"]
    n = 6

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = prompts[(k + i) % len(prompts)]
            status, b = _complete(url, {"prompt": prompt, "max_tokens": n, "temperature": 0})
            if status != 200:
                failures.append(f"{status}: {b}")
            else:
                answers.append((b["system_fingerprint"], prompt, b["choices"][0]["text"]))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    try:
        deadline = time.monotonic() + 240
        health = None
        while time.monotonic() < deadline and server.poll() is None and health is None:
            try:
                health = _get(url, "/health")
            except OSError:
                time.sleep(1)
        assert health is not None, log.read_text()[-3000:]
        base = health["weights"]
        assert base == read_meta(work / "results/model/base").model_sha256
        doc = json.loads(endpoint.read_text())
        assert (
            doc["url"] == url
            and doc["token_env"] == TOKEN_ENV
            and TOKEN not in endpoint.read_text()
        )
        for t in threads:
            t.start()

        # steps of 1.5 s: each push ends before the next checkpoint (a push that comes while one
        # runs is skipped, and step 4's must happen to be killed in)
        faults = paced_env(fault_env(tmp_path / "faults.json", env, kill_mid_push=4), 1.5)
        run_snakemake(work, "train", configfiles=(TINY, train_yaml), env=faults)
        time.sleep(1.0)  # answers after the last push
        stop.set()
        for t in threads:
            t.join(120)

        ranks = (work / "logs/train/rank0.log").read_text()
        assert "killing rank 0 with stage 1's part unsent" in ranks
        assert "resuming from" in ranks
        pushed = [line for line in ranks.splitlines() if ": pushed to " in line]
        assert any("step 8: pushed to" in line for line in pushed), ranks[-3000:]
        served = log.read_text()
        assert "not updated, the served weights are unchanged" in served  # step 4's, half sent
        health = _get(url, "/health")
        run = re.findall(r"run identity (\w+):", ranks)[-1]  # this run's (the log is appended)
        index = work / f"results/train/checkpoints/{run}/step-00000008/checkpoint.json"
        final = json.loads(index.read_text())["sha256"]["model.safetensors"]
        assert health["weights"] == final != base
        # the final folder holds the same tensors in the same bytes: a fresh server on it, or an
        # update from it, names them as the push did
        assert read_meta(work / "results/train/final").model_sha256 == final
        assert health["last_update"]["kind"] == "training push"
        assert "step 8" in health["last_update"]["source"]

        assert not failures, failures[:5]
        folders = _folders_by_fingerprint(work)
        seen = {fp for fp, _, _ in answers}
        assert fingerprint(base) in seen and fingerprint(final) in seen, seen
        assert seen <= set(folders), seen - set(folders)
        ref = {}
        for fp, prompt, text in answers:
            if (fp, prompt) not in ref:
                ref[fp, prompt] = _greedy(folders[fp], prompt, n)
            assert text == ref[fp, prompt], (fp, prompt, text, ref[fp, prompt])
    finally:
        stop.set()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    assert not endpoint.exists(), "the endpoint goes with the server"


# ----------------------------------------------------------------------------- the trainer's side


def test_the_same_weights_have_the_same_digest_in_every_process(tmp_path):
    """What names pushed weights is the sha256 of the file a checkpoint of them holds, so it must
    not depend on the process (safetensors writes its metadata from a hash map: one key only)."""
    code = (
        "import torch, sys; from distlm.model.folder import safetensors_sha256, save_safetensors; "
        "g = torch.Generator().manual_seed(0); "
        "t = {n: torch.randn(4, 3, generator=g) for n in ('b', 'a', 'c.weight', 'c.bias')}; "
        "save_safetensors(t, __import__('pathlib').Path(sys.argv[1])); print(safetensors_sha256(t))"
    )
    digests = set()
    for k in range(3):
        f = tmp_path / f"{k}.safetensors"
        out = subprocess.run(
            [sys.executable, "-c", code, str(f)], capture_output=True, text=True, check=True
        )
        digests |= {out.stdout.strip(), sha256_file(f)}
    assert len(digests) == 1, digests


def test_training_goes_on_when_the_server_is_gone_or_its_endpoint_is_not_one(tmp_path, caplog):
    """A stale endpoint (its server gone) and an endpoint that is not one (another scheme): each
    checkpoint's push is logged and skipped, and training ends as without them."""
    from harness.synthetic import make_inputs
    from test_train import paths, train_cfg

    from distlm.train import run_training

    inputs = make_inputs(tmp_path / "in")
    for name, url in (("gone", f"http://127.0.0.1:{free_port()}"), ("bad", "file:///etc/passwd")):
        out = tmp_path / name / "results" / "train"
        endpoint = out.parent / "serve" / "endpoint.json"
        endpoint.parent.mkdir(parents=True)
        doc = {"format": "distlm-serve-endpoint/1", "url": url, "hostname": "h", "pid": 1}
        endpoint.write_text(json.dumps(doc))
        caplog.clear()
        with caplog.at_level("INFO", logger="distlm"):
            meta = run_training(train_cfg(max_steps=4, ckpt_every=2), paths(inputs, out))
        assert meta is not None and (out / "final" / "model.safetensors").is_file()
        text = caplog.text
        if name == "gone":
            assert "step 4: not pushed to " + url + " (training goes on)" in text, text[-2000:]
            assert "Connection refused" in text
        else:
            assert "endpoint.json: not read" in text and "url" in text, text[-2000:]
            assert "offering" not in text


def _following_server(workflow_run: Path, tmp_path: Path, *, stages: int):
    """A server of `stages` stages on the main job's base model that follows a training run whose
    outputs go to tmp_path/results/train: (server, its endpoint document, the run's folder, the
    run's inputs: the main job's tokens, tokenizer and base model)."""
    from test_server import start_server

    from distlm.model import write_pipeline_dir

    base = workflow_run / "results/model/base"
    pipeline = tmp_path / f"s{stages}"
    write_pipeline_dir(base, pipeline, stages=stages)
    out = tmp_path / "results" / "train"
    endpoint = out.parent / "serve" / "endpoint.json"
    server = start_server(
        pipeline,
        stages,
        tmp_path,
        serve={"follow_training": True},
        args=("--endpoint", str(endpoint)),
    )
    inputs = {
        "tokens": workflow_run / "results/data/tokens.h5",
        "tokenizer": workflow_run / "results/data/tokenizer",
        "model": base,
    }
    return server, endpoint, out, inputs


@pytest.mark.slow
def test_fsdp_ranks_push_their_gathered_weights(workflow_run, tmp_path):
    """Under fsdp every rank takes part in gathering the weights to rank 0, which pushes them into
    a one-stage server: it ends on the final folder's weights (the same digest) and answers
    `generate`'s greedy text on them."""
    from test_server import TOKEN, TOKEN_ENV, stop_server
    from test_train import _torchrun_cmd, train_cfg

    server, endpoint, out, inputs = _following_server(workflow_run, tmp_path, stages=1)
    try:
        assert json.loads(endpoint.read_text())["url"] == server.base
        cfg = train_cfg(parallel="fsdp", max_steps=4, ckpt_every=2)
        cmd, env = _torchrun_cmd(cfg, inputs, out, env={**os.environ, TOKEN_ENV: TOKEN})
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=env, check=False
        )
        log = (out / "logs" / "rank0.log").read_text()
        assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
        assert "step 4: pushed to" in log, log[-3000:]
        final = read_meta(out / "final").model_sha256
        status, h = server.request("GET", "/health")
        assert status == 200 and h["weights"] == final and "step 4" in h["last_update"]["source"]
        body = {"prompt": "The", "max_tokens": 6, "temperature": 0}
        status, b = server.request("POST", "/v1/completions", body)
        assert status == 200 and b["system_fingerprint"] == fingerprint(final)
        assert b["choices"][0]["text"] == _greedy(out / "final", "The", 6)
    finally:
        stop_server(server)
    assert not endpoint.exists()


@pytest.mark.slow
def test_a_server_killed_mid_push_stops_no_training(workflow_run, tmp_path):
    """The server (its whole process group, SIGKILL) dies as step 2's push is offered: training
    goes on to its end, every later checkpoint's push is logged as not pushed (the endpoint it
    left behind names a server that is gone), and the run's outputs are whole."""
    from test_server import TOKEN, TOKEN_ENV
    from test_train import _torchrun_cmd, train_cfg

    server, _endpoint, out, inputs = _following_server(workflow_run, tmp_path, stages=2)
    cfg = train_cfg(max_steps=6, ckpt_every=2, eval_every=6)
    cmd, env = _torchrun_cmd(cfg, inputs, out, env=paced_env({**os.environ, TOKEN_ENV: TOKEN}, 1.0))
    rank0 = out / "logs" / "rank0.log"
    train = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and train.poll() is None:
            if rank0.is_file() and "step 2: offering weights" in rank0.read_text():
                break
            time.sleep(0.02)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        output = train.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        if train.poll() is None:
            train.kill()
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
    log = rank0.read_text()
    assert train.returncode == 0, output[-3000:] + log[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and (out / "metrics.csv").is_file()
    assert "step 4: not pushed" in log, log[-3000:]  # to a server that is gone, or skipped
    assert f"step 6: not pushed to {server.base} (training goes on)" in log, log[-3000:]
    assert "step 4: pushed to" not in log and "step 6: pushed to" not in log

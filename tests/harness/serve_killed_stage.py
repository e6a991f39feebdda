"""Inside a SLURM batch job: start the API server (its job through `srun`), then kill a stage
mid-request.

    python serve_killed_stage.py CONFIG MODEL PORT

Prints HEALTH (stage, host, pid), the status of a completion, then SIGSTOPs stage 1 (on this node)
with a request in flight, SIGKILLs it and prints AFTER_KILL with the seconds and the response, then
FRONT_RC: the API server's exit code. tests/test_slurm.py reads these lines.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SERVE = "distlm.entry.serve"  # the serve entry point, as rule serve starts it
config, model, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = f"http://127.0.0.1:{port}"


def request(method, path, body=None, timeout=60):
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode() if body else None, method=method
    )
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


front = subprocess.Popen(
    [
        sys.executable,
        "-m",
        SERVE,
        "--launcher",
        "srun --mpi=pmi2 -n 3",
        "--config",
        config,
        "--model",
        model,
    ]
)
deadline = time.monotonic() + 180
while True:
    try:
        status, text = request("GET", "/health", timeout=2)
        if status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline or front.poll() is not None:
        sys.exit(f"the server did not come up (front exit code {front.poll()})")
    time.sleep(0.5)


def say(key: str, value) -> None:
    """One line in one write(2): the job's log is shared with the server and the ranks, and with
    PYTHONUNBUFFERED print() writes its pieces one by one, so a log line could land inside ours
    ("HEALTH2026-11-24 ... [rank api] ..." then " [[0, ...")."""
    os.write(1, f"{key} {value}\n".encode())


stages = json.loads(text)["pipeline"]
say("HEALTH", json.dumps([[s["stage"], s["host"], s["pid"]] for s in stages]))
say("COMPLETION", request("POST", "/v1/completions", {"prompt": "A class", "max_tokens": 5})[0])
victim = stages[1]
if victim["host"] != os.uname().nodename:
    sys.exit(f"stage 1 runs on {victim['host']}, not on the batch host {os.uname().nodename}")
os.kill(victim["pid"], signal.SIGSTOP)  # the next request stays in flight
out = {}
body = {"prompt": "A", "max_tokens": 5}
client = threading.Thread(target=lambda: out.update(r=request("POST", "/v1/completions", body)))
client.start()
time.sleep(2)
t0 = time.monotonic()
os.kill(victim["pid"], signal.SIGKILL)
client.join()
say("AFTER_KILL", json.dumps([round(time.monotonic() - t0, 1), *out["r"]]))
say("FRONT_RC", front.wait(timeout=120))

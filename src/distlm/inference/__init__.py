"""Pipeline-parallel inference over MPI: one rank per model stage, lanes of prompts in flight,
and an OpenAI-compatible API server in front of it. Two programs, one subpackage each, and what
both speak here:

    prompts.py     prompt files, relative path lookup, prompt tokens, RequestError (no torch)
    sampling_params.py  what a request asks of its tokens (SamplingParams: greedy, or
                   temperature / top-k / top-p with a seed, the log-probabilities asked for);
                   the tokens are picked by engine/sampler.py
    request.py     the one request path: prompts + SamplingSettings -> a validated request
    stats.py       StageInfo / StageStats / StageBrief: what a stage reports about itself
    messages.py    the engine channel's typed, versioned messages (msgpack over ZeroMQ)

engine/  the pipeline (inside the MPI job)
    pipeline_stage.py  a pipeline stage's blocks and per-lane KV caches (packed micro-batches)
    micro_batch.py a micro-batch's items and where its tokens go (the decode rows' attention)
    graphs.py      decode steps as CUDA graphs (static steps over the KV cache) on a GPU
    ring.py        the ring of stages: topology, MPI links, versioned ring messages, wire format
    sampler.py     the last stage: per-lane sampling state, a micro-batch's picks (pick_token:
                   where a served token is picked)
    scheduler.py   stage 0: lane policy, micro-batches, run_stage0 (the one stage-0 loop)
    worker.py      stages 1..S-1: forward what arrives, pass it on
    bootstrap.py   starting a rank: threads, its shard, the ring, MPI_Abort on any failure
    batch.py       the inference stage: a prompt file in, generations and timing out
    serve.py       serve mode inside the job: stage 0 takes requests over ZeroMQ
    update.py      a live weight update: each stage's new weights made ready beside the served
                   ones, then every stage switched between two micro-batches, or none

server/  the API server (one process outside the job)
    supervisor.py  the process: uvicorn, the MPI job it starts and watches, signals
    transport.py   uvicorn's httptools with a header deadline and size, a lingering close, one write
                   a turn; the open-file limit
    app.py         Starlette routes: /v1/completions, /v1/chat/completions (one request path),
                   /v1/models, /health, /metrics, /update_weights_from_disk
    updates.py     the update route: its body, who may, waiting for the engine's answer
    state.py       what the routes hold, and the narrow objects of the two steps below
    requests.py    the completions and chat request models, body limits, JSON guards
    chat.py        a chat's messages checked and rendered by the folder's chat template
    prepare.py     a request made ready (either route): checked, tokenized (through request.py)
    answer.py      answering: one JSON completion or server-sent events; cancellation
    render.py      one answer as events arrive: text, stop strings, logprobs, usage
    shapes.py      how an answer looks: completion or chat completion, whole or in chunks
    client.py      the engine client: submit, cancel, events to their requests
    responses.py   the typed answers (completion, chat completion, chunks, models, health, error)
    errors.py      ApiError and OpenAI's error body
    metrics.py     the server's Prometheus series
    access_log.py  one escaped line per request

The server never imports engine/ (torch, MPI): a contract in pyproject.toml checks it.
"""

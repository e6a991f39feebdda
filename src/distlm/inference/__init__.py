"""Pipeline-parallel inference over MPI: one rank per model stage, lanes of prompts in flight.

prompts.py     prompt files, relative path lookup, prompt tokens (no torch: the DAG imports it)
sampling.py    greedy / temperature / top-k / top-p with a per-sequence seed, bounded
stage.py       a stage's GPT-2 blocks and per-lane KV caches (packed micro-batches)
pipeline.py    the MPI ring (named messages), stage 0's scheduler, the batch stage
messages.py    the engine channel's named, versioned messages (msgpack over ZeroMQ)
engine.py      serve mode inside the MPI job: stage 0 takes requests from the API server
api.py         serve mode's HTTP side: OpenAI completions (FastAPI), limits, metrics, access log
supervisor.py  the API server process: uvicorn, the MPI job it starts and watches, signals
"""

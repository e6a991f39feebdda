"""Pipeline-parallel inference over MPI: one rank per model stage, lanes of prompts in flight.

    prompts.py   prompt files, relative path lookup, prompt tokens (no torch: the DAG imports it)
    sampling.py  greedy / temperature / top-k / top-p with a per-sequence seed
    stage.py     a stage's GPT-2 blocks and per-lane KV caches (packed micro-batches)
    pipeline.py  the MPI ring, stage 0's scheduler, the batch stage (prompts -> JSONL + timing)
    server.py    serve mode: an OpenAI-compatible /v1/completions on stage 0
"""

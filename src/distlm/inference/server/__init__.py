"""The API server: one process outside the MPI job, in front of the engine (distlm.inference)."""

"""The pipeline engine: the MPI job, one rank per model stage (see distlm.inference)."""

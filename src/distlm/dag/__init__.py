"""The workflow's own modules, which Snakemake imports while it builds the DAG (no torch): the
one table of the stages (`stages`) and the tables generated from it (`tables`), a config's runs
(`sweep`), and reading a config file into typed settings (`config`)."""

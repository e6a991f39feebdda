"""The runtime a rank stands on, whatever its stage: its ranks (`dist`: `Topology`, the process
group, `agree`), its device (`device`: `DeviceBackend`, the one place that decides by device
type; `machine`: the same questions without torch, for the workflow), its host (`host`: thread
budgets, the C heap), joining an MPI world (`mpi_init`), dying with its launcher (`lifeline`),
its start-up heap (`heap`), a time-limit warning that comes early (`stop_latch`), and one
trainer a folder (`lease`)."""

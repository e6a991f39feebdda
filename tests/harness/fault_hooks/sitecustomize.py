"""Test faults for a training stage started as the user starts it (tests/harness/faults.py).
Python imports this module at start-up when its folder is on PYTHONPATH (`fault_env` puts it
there); it acts only in a training rank (RANK set) when DISTLM_TEST_FAULTS names a spec file (a
JSON object of FaultSpec's fields; another field is a TypeError naming it), and then sets
distlm.train.faults.REQUESTED from it; nothing else changes."""

import json
import os

SPEC = os.environ.get("DISTLM_TEST_FAULTS")
if SPEC and "RANK" in os.environ:
    from distlm.train import faults

    with open(SPEC, encoding="utf-8") as f:
        faults.REQUESTED = faults.FaultSpec(**json.load(f))

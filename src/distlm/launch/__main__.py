"""`python -m distlm.launch`: the distlm-launch command (each srun task runs `torchrun-node`)."""

import sys

from distlm.launch import main

sys.exit(main())

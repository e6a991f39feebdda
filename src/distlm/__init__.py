"""distlm: a GPT-2-class language model from raw text to generated text across many processes.

The library behind the Snakemake workflow; every stage script is a thin entry point into it.
"""

__version__ = "0.1.0"


class DistlmError(RuntimeError):
    """An error the user can act on: the message names the file, field or rank at fault."""

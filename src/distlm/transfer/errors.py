"""The error every rank of a transfer raises when it fails."""

from distlm import DistlmError

TRANSPORTS = ("torch", "uccl")  # the data planes (distlm.transfer.planes); never substituted


class TransferError(DistlmError):
    """A transfer failed: the message names the rank, tensor or bucket at fault."""

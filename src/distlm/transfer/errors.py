"""The error every rank of a transfer raises when it fails."""

from distlm import DistlmError


class TransferError(DistlmError):
    """A transfer failed: the message names the rank, tensor or bucket at fault."""

"""The loader's error: a checkpoint that cannot be loaded, named by the file or tensor at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""

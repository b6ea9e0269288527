"""How an FSDP run fails: the errors `run` raises beyond ValueError (bad arguments)."""


class FsdpError(RuntimeError):
    """A run that did not complete. `pids` are the rank processes it started (all of them
    killed and reaped before this is raised); `rank` the failing rank, when one failed."""

    def __init__(self, message, pids=(), rank=None):
        super().__init__(message)
        self.pids = list(pids)
        self.rank = rank


class FsdpTimeout(FsdpError, TimeoutError):
    """The ranks did not finish within the run's timeout."""


class GlooUnavailable(RuntimeError):
    """This torch build has no torch.distributed or no gloo backend."""


def gloo_available():
    """Whether torch.distributed with the gloo backend can run here (the harness needs both)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.is_available() and dist.is_gloo_available()

"""The one failure tensor parallelism adds to an engine's."""


class RankLost(RuntimeError):
    """A tensor-parallel worker rank died or stopped answering: the engine cannot step."""

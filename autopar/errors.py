"""Errors a user can cause. Each message names the rule, the value and what is valid."""


class AutoparError(ValueError):
    """Base class of every error autopar raises for bad input."""


class MeshError(AutoparError):
    """A mesh shape or axis name that cannot be used."""


class ShardingError(AutoparError):
    """A sharding that does not apply to a tensor (e.g. a dimension that does not divide)."""


class PlanError(AutoparError):
    """A plan file that is corrupt, of the wrong version, or does not match the model."""


class ClusterError(AutoparError):
    """A cluster description or preset name that cannot be used."""


class LaunchError(AutoparError):
    """Running a plan outside a matching torchrun job."""


class InfeasibleError(AutoparError):
    """No plan fits the per-device memory budget, or the solver found none in time."""

    def __init__(self, message: str, *, needed_bytes: float | None = None, status: str = "INFEASIBLE"):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.status = status
        """The solver's verdict: INFEASIBLE (proved), or what stopped it (TIME LIMIT)."""


class RankMismatchError(AutoparError):
    """Ranks that should hold the same tensors (initial state, a global batch) hold different ones."""


class OutputError(AutoparError):
    """An output path that cannot be written, or whose existing contents autopar will not overwrite."""


class FactoryError(AutoparError):
    """A model factory (FILE.py:FACTORY) that cannot be imported or raised when called."""


class InputError(AutoparError):
    """Example inputs autopar cannot trace (e.g. a value that is not a tensor)."""

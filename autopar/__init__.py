"""autopar: an automatic parallelization compiler for PyTorch training.

    plan = autopar.compile(model, example_inputs, mesh=(2, 2), cluster="dgx-a100", loss_fn=loss_fn)
    pmodel = autopar.autoparallelize(model, example_inputs, mesh=(2, 2), cluster="dgx-a100", loss_fn=loss_fn)
"""
from autopar.api import autoparallelize
from autopar.compiler import compile
from autopar.errors import (
    AutoparError, ClusterError, FactoryError, InfeasibleError, InputError, LaunchError, MeshError, OutputError,
    PlanError, RankMismatchError, ShardingError,
)
from autopar.mesh import Mesh, parse_mesh
from autopar.plan import Plan
from autopar.runtime import shutdown

__all__ = [
    "autoparallelize", "compile", "Plan", "Mesh", "parse_mesh", "AutoparError", "ClusterError",
    "InfeasibleError", "LaunchError", "MeshError", "PlanError", "ShardingError", "RankMismatchError", "OutputError",
    "FactoryError", "InputError", "shutdown",
]
__version__ = "0.1.0"

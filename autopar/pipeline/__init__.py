"""Pipeline (inter-operator) parallelism: cut the captured training step into
layers, choose stages, microbatches and schedule, and write the plan's
``pipeline`` section.

    compile_pipelined(model, inputs, mesh="pp=2,tp=2", ...)      the pp axis is given
    compile_pipelined(model, inputs, mesh=1024, ...)              the planner factors the world
                                                                  into pp x dp x tp (or does not pipeline)

The steps, in order:

1. **Layers** (``layers.py``, ``group_layers``). Every op of the captured graph
   belongs to a layer: its module path truncated at the repeated container
   (``blocks.3``), or the top-level module (``tok``, ``head``); an op called at
   the top level (a residual add, the loss) joins the latest layer among its
   inputs. Layers are ordered by first use, and an op never sits in an earlier
   layer than its inputs, so every cut between layers is a valid stage
   boundary: the tensors crossing it (``Layers.crossing``) are exactly what is
   sent, including long skip connections, which intermediate stages relay. Ops
   that depend on no parameter (``arange``, views of the target) are
   *floating*: each stage that needs them recomputes them, and the user inputs
   reach every stage directly.
2. **Price** (``pricing.py``, ``profile``). The flat planner
   (autopar/planner.py: ``prepare`` and ``Problem.solve`` with ``stage=True``,
   identical layers sharing variables) is solved once per stage submesh shape
   and microbatch size on the whole microbatch graph; each layer's cost is the
   sum over its nodes of the flat planner's own accounting of the plan
   (``planner.node_costs``, which the flat plan's totals sum too): compute
   (forward, backward) and activation resharding, its gradient
   synchronisation (once per step), its parameter, gradient and optimizer
   bytes and saved activations. A tensor crossing a cut travels in its
   producer's placement, each rank sending its shard to its peer
   (``cut_placements``), so the edges around a cut cost what the ILP priced; a
   Partial sum is reduced before it is sent (``Cut``). The ILP does not know
   where the cuts fall, and it weighs gradient synchronisation once per
   microbatch; the runtime reduces replicated parameters' gradients once per
   step, in buckets (``once_per_step``), and the stage pricing counts them so. When the
   planner factors the world, a model with many identical layers is priced on a
   copy truncated to two of them (checked against a three-layer copy) and their
   costs are reused for every layer.
3. **Stages** (``stages.py``, ``partition``, ``evaluate``). A dynamic program
   over contiguous layer ranges minimises the slowest stage's time per
   microbatch (compute, resharding, point-to-point transfers of the crossing
   tensors on the pp axis) subject to each stage's memory: parameters,
   optimizer states and gradients plus the activations of the microbatches it
   holds (1F1B: stage s holds min(m, p - s), GPipe all m, interleaved a factor
   1 + (p-1)/(p v) more); with full recomputation a numbered layer
   (``blocks.3``) keeps only its inputs and one such layer's activations are
   live at a time, as autopar/codegen.py checkpoints them.
4. **Step time** (``stages.py``): (m + (p - 1)/v) x slowest stage (the bubble
   is (p-1)/m of the work, (p-1)/(v m) interleaved) plus the exposed gradient
   synchronisation of the slowest stage.

Then ``search.py`` factors the devices into pp x dp x tp, or plans on a given
pp axis (``compile_pipelined``), and ``planfile.py`` writes the plan's
``pipeline`` section, stage ranks and per-stage tables.
"""
from autopar.pipeline.layers import Layers, group_layers
from autopar.pipeline.planfile import (
    PP_AXIS, build_pipeline_plan, inner_spec, microbatch_inputs, plan_from_candidate, stage_ranges, stage_rows,
)
from autopar.pipeline.pricing import Profile, cut_placements, profile, zero1_axis
from autopar.pipeline.search import PipelineSearch, compile_pipelined, search_pipeline
from autopar.pipeline.stages import Candidate, Schedule, bubble_fraction, evaluate, partition, should_pipeline

__all__ = ["compile_pipelined", "search_pipeline", "should_pipeline", "bubble_fraction", "group_layers",
           "Schedule", "Layers", "Candidate", "PipelineSearch", "Profile", "profile", "partition", "evaluate",
           "cut_placements", "zero1_axis", "inner_spec", "microbatch_inputs", "stage_ranges", "stage_rows",
           "build_pipeline_plan", "plan_from_candidate", "PP_AXIS"]

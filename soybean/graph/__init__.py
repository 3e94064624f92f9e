"""Annotate + enumerate: the planning graph of a captured model on one mesh.

Every tensor-producing fx node becomes a *variable* whose domain is its list of
N-D strategies (placeholders: the tilings a parameter, buffer or input may be
stored in; ops: the rule's strategies; the output: all-``R``, the full-output
contract).  Every (producer output -> consumer input) use becomes an *edge*
whose cost matrix ``C[s, t]`` prices resharding producer strategy ``s``'s output
into consumer strategy ``t``'s input, forward and backward.

A value used more than once gets a *reshard point*: a variable between the
producer and its consumers whose domain is (tiling ``T``, axes ``A`` whose
gradient it collects partially).  Consumers that want the same tiling then
share one collective, and partial gradients of replicated uses (Megatron's
``f`` for q, k and v, or the gradient sync of a tied weight) are summed
locally and all-reduced once, as the runtime does.

Edge semantics are decided here, once: which values need a gradient (``Var.needs_grad``),
where each use reads its value from (the producer, or the shared reshard point), on which axes
a replicated use's gradient is partial (the consumer splits its work there), which axes a
reshard point sums partial gradients over, and which gradient all-reduce is a parameter's own,
deferred to the runtime's bucketed gradient sync (``Edge.deferred``), and which stored tensors an
op updates in place through a resharded copy (a *write-back* edge: batch norm's running
statistics, stored whole and updated channel-split, travel back to their stored tiling).  Each
edge keeps, per pair of strategies, the ``reshard.Route`` these make; the cost model prices it and codegen
emits it.  Built with ``fixed=plan``, every variable's domain is the one strategy the plan
chose: the graph codegen lowers.

The package: ``types`` (``Var``, ``Edge``, ``PlanGraph``), ``build`` (``build`` and what it decides),
``units`` (layers and recomputation units), ``writes`` (in-place writes), ``phases`` (the step's memory
phases), ``pinning`` (how a baseline holds a parameter to its stored tiling).
"""
from .build import (
    OUTPUT,
    NoStrategyLeft,
    SharedWork,
    backend_only,
    build,
    edge_profile,
    fallback_ops,
    gc_paused,
    op_key,
    read_profile,
    returned_sum,
    value_name,
    value_source,
)
from .phases import budget_memory, freed_after, least_peak, phase_memory, phase_peaks, rerun_freed
from .pinning import PINNED, pinned_use, use_tiling
from .types import Edge, PlanGraph, Var, VarKind
from .units import attention_units, layer_of, node_layer, node_module, recomputable_layers, unit_of
from .writes import written_inputs

__all__ = ["OUTPUT", "PINNED", "NoStrategyLeft", "SharedWork", "Edge", "PlanGraph", "Var", "VarKind", "attention_units",
           "backend_only", "build",
           "edge_profile", "fallback_ops", "gc_paused", "freed_after", "layer_of", "node_layer", "node_module",
           "op_key",
           "phase_memory", "phase_peaks", "budget_memory", "least_peak", "pinned_use", "read_profile",
           "recomputable_layers", "rerun_freed",
           "returned_sum", "unit_of", "use_tiling", "value_name", "value_source", "written_inputs"]

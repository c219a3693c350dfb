"""Splitting a model into stages: cut points, the dry run and partition, costs, meta init, stand-ins.

Modules: :mod:`~.cut`, :mod:`~.partition` (balancing, the partition), :mod:`~.data_flow` (the dry run's
data flow, side inputs), :mod:`~.segment_costs`, :mod:`~.meta_init` (models built on the meta device),
:mod:`~.stand_ins` (keeping one stage of a model), :mod:`~.no_trace` (the dry run leaves the model as it was).
"""

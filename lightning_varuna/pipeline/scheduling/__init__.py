"""Schedules as data: generators, timing simulation, lowering to each link's messages, NCCL's rules as a replay.

Modules: :mod:`~.schedules`, :mod:`~.simulator`, :mod:`~.lowering` (the p2p plan), :mod:`~.nccl_replay`. Pure
functions: no process group is needed.
"""

"""Schedules as data: generators, timing simulation, lowering to each link's messages, NCCL's rules as a replay.

Modules: :mod:`~.schedules`, :mod:`~.simulator`, :mod:`~.lowering` (the message order), :mod:`~.nccl_replay`. Pure
functions: no process group is needed.
"""

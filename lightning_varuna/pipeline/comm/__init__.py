"""Communication between ranks: p2p transfers on links, gradient sync, the replicas' initial broadcast, events.

Modules: :mod:`~.transfers`, :mod:`~.grad_sync`, :mod:`~.initial_sync`, :mod:`~.events` (the event hook the
executor and its transfers report to; below the runtime, which imports it).
"""

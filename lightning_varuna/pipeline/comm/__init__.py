"""Communication between ranks: p2p transfers on links, gradient sync, the replicas' initial broadcast.

Modules: :mod:`~.transfers`, :mod:`~.grad_sync`, :mod:`~.initial_sync`.
"""

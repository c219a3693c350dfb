"""``varuna-store``: a job store that outlives the training processes, for in-place recovery.

    varuna-store --port 29500            # on a machine that is not preempted (or beside the launcher)

Training processes then join the job there as clients (``VarunaStrategy(recovery_store="host:29500")``), so the
store survives any of them. It is torch's own ``TCPStore`` server; it runs until it is stopped (SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, declared for type checkers only here

__all__ = ["main", "serve"]


def serve(port: int, host: str = "0.0.0.0", stop: threading.Event | None = None) -> None:  # noqa: S104 - a server
    """Serves a ``TCPStore`` on ``host:port`` until ``stop`` is set (or forever)."""
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"varuna-store: serving on {host}:{store.port}", flush=True)
    (stop or threading.Event()).wait()


def main(argv: list[str] | None = None) -> None:
    """The ``varuna-store`` command line."""
    parser = argparse.ArgumentParser(prog="varuna-store", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29500, help="TCP port to serve on (default 29500)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")  # noqa: S104
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.port, args.host, stop)


if __name__ == "__main__":
    main()

"""Two torchrun "nodes" on this host (``--nnodes=2``, ``Trainer(num_nodes=2)``): placement and equivalence."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import python, torchrun_nodes
from helpers.results import rank_result


@pytest.mark.slow
def test_two_nodes_keep_each_pipeline_on_one_node_and_match_the_plain_run(tmp_path: Path) -> None:
    """P=2 x D=2 over 2 nodes of 2 processes: each replica's pipeline sits on one node (its p2p stays there), the
    replicas of a stage are on different nodes, and training matches the plain single-process run."""
    python("equivalence.py", str(tmp_path), "reference:steps=3")
    torchrun_nodes("equivalence.py", str(tmp_path), "nodes:pipeline_parallel_size=2,num_microbatches=4,batch=8,steps=3",
                   nodes=2, nproc=2)
    reference = rank_result(tmp_path, "reference")
    seen = set()
    for rank in range(4):
        run = rank_result(tmp_path, "nodes", rank)
        assert (run["node"], run["replica"], run["stage"]) == (rank // 2, rank // 2, rank % 2)
        assert len(run["losses"]) == len(reference["losses"]) == 3
        for got, want in zip(run["losses"], reference["losses"]):
            assert abs(got - want) < 5e-4
        for param, grad in run["grads"].items():
            assert max(abs(a - b) for a, b in zip(grad, reference["grads"][param])) < 1e-5, param
            seen.add(param)
    assert seen == set(reference["grads"])

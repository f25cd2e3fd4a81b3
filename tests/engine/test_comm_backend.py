"""Which process groups take CPU tensors (`reduces_cpu_tensors`): the small control collectives
(losses, agreement, JSON) go through the GPU only where no backend of the group serves the CPU.
The launcher's mixed backend is compared too: a plain `== "nccl"` test read it wrong for every
per-device spelling (`cuda:nccl` alone sent CPU tensors to NCCL)."""

from __future__ import annotations

import pytest

from tierzero.distributed.comm import reduces_cpu_tensors


@pytest.mark.parametrize(
    ("backend", "cpu"),
    [
        ("gloo", True),
        ("nccl", False),
        ("NCCL", False),
        ("mpi", True),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl,cpu:gloo", True),
        ("cuda:nccl", False),
        ("cpu:gloo", True),
    ],
)
def test_a_group_takes_cpu_tensors_where_a_backend_serves_the_cpu(backend: str, cpu: bool) -> None:
    assert reduces_cpu_tensors(backend) is cpu

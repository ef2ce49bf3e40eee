"""The torch.distributed calls of a training loop on TorchTPU's tpu_dist, on the chip (world size 1):
the table the emulated tpu_dist must match (tests/runtime/test_dist_table.py runs the same one)."""

from __future__ import annotations

from .dist_table import mismatches, run


def test_every_call_of_the_table_as_torch_tpu_does(tpu, process_group):
    outcomes = run(tpu, rank=0, world=1)
    print("\n".join(f"{name}: {got or 'works'}" for name, got in outcomes.items()))
    assert mismatches(outcomes, world=1) == {}

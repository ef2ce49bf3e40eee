"""The torch.distributed calls a training loop makes, one by one on the default `tpu_dist` group.

One table for both sides: tests/real_tpu/test_dist_table.py runs it on a TPU chip (TorchTPU, world size
1: one chip, one process), tests/runtime/test_dist_table.py on emulated slices (a TorchTrainer on a v6e
2x2, and one process as on the chip). Each call works on both, or fails on both with the same words:
`run` returns each call's outcome (None when it worked and gave the right result, else the error's type
and words), `mismatches` compares them with `expected`.

Point to point needs a peer: at world size 1 `send` and `recv` are refused by torch itself (the same
words everywhere); `isend`, `irecv` and `batch_isend_irecv` have no such check and would wait on
themselves, so they run only where there is a peer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

HOST_TENSOR = "No backend type associated with device type cpu"  # TorchTPU's words (v5e, 2026-12-06)
SELF_PEER = "rank should not be the same as the rank of the current process"  # torch's own check
NEEDS_PEER = frozenset({"isend/irecv", "batch_isend_irecv"})


class Table:
    """The calls, for one rank of a world of `world` ranks on `device`."""

    def __init__(self, device: torch.device, rank: int, world: int) -> None:
        self.dev, self.rank, self.world = device, rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world

    def calls(self) -> dict[str, Callable[[], None]]:
        calls = {
            "get_backend": self.get_backend,
            "barrier": dist.barrier,
            "all_reduce": self.all_reduce,
            "all_reduce of a host tensor": lambda: dist.all_reduce(torch.ones(2)),
            "broadcast": self.broadcast,
            "all_gather_into_tensor": self.all_gather_into_tensor,
            "reduce_scatter_tensor": self.reduce_scatter_tensor,
            "all_to_all_single": self.all_to_all_single,
            "all_gather_object": self.all_gather_object,
            "broadcast_object_list": self.broadcast_object_list,
            "gather_object": self.gather_object,
            "scatter_object_list": self.scatter_object_list,
            "new_group": self.new_group,
            "new_subgroups": self.new_subgroups,
            "send/recv": self.send_recv,
            "isend/irecv": self.isend_irecv,
            "batch_isend_irecv": self.batch_isend_irecv,
        }
        return {k: v for k, v in calls.items() if self.world > 1 or k not in NEEDS_PEER}

    # -- tensors --------------------------------------------------------------------------------------
    def _check(self, got: torch.Tensor, want: torch.Tensor | float) -> None:
        want_t = torch.as_tensor(want, dtype=got.dtype).expand(got.shape)
        if not torch.equal(got.cpu(), want_t):
            raise AssertionError(f"wrong result on rank {self.rank}: {got.cpu().tolist()}")

    def get_backend(self) -> None:
        if dist.get_backend() != "tpu_dist":
            raise AssertionError(f"get_backend() is {dist.get_backend()!r}")

    def all_reduce(self) -> None:
        t = torch.full((4,), float(self.rank + 1), device=self.dev)
        dist.all_reduce(t)
        self._check(t, self.world * (self.world + 1) / 2)

    def broadcast(self) -> None:
        t = torch.full((3,), float(self.rank), device=self.dev)
        dist.broadcast(t, src=0)
        self._check(t, 0.0)

    def all_gather_into_tensor(self) -> None:
        out = torch.empty(2 * self.world, device=self.dev)
        dist.all_gather_into_tensor(out, torch.full((2,), float(self.rank), device=self.dev))
        self._check(out, torch.arange(self.world, dtype=torch.float32).repeat_interleave(2))

    def reduce_scatter_tensor(self) -> None:
        out = torch.empty(2, device=self.dev)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * self.world, device=self.dev))
        r = self.rank
        self._check(out, torch.arange(2.0 * self.world)[2 * r : 2 * r + 2] * self.world)

    def all_to_all_single(self) -> None:
        out = torch.empty(self.world, device=self.dev)
        dist.all_to_all_single(
            out, torch.arange(self.world, device=self.dev, dtype=torch.float32) + 10 * self.rank
        )
        self._check(out, torch.arange(self.world, dtype=torch.float32) * 10 + self.rank)

    # -- objects --------------------------------------------------------------------------------------
    def _same(self, got: object, want: object) -> None:
        if got != want:
            raise AssertionError(f"wrong result on rank {self.rank}: {got!r}")

    def all_gather_object(self) -> None:
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, {"rank": self.rank})
        self._same(out, [{"rank": r} for r in range(self.world)])

    def broadcast_object_list(self) -> None:
        objs: list[object] = [{"from": self.rank}, "x"]
        dist.broadcast_object_list(objs, src=0)
        self._same(objs, [{"from": 0}, "x"])

    def gather_object(self) -> None:
        out: list[object] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(("r", self.rank), out, dst=0)
        if self.rank == 0:
            self._same(out, [("r", r) for r in range(self.world)])

    def scatter_object_list(self) -> None:
        out: list[object] = [None]
        dist.scatter_object_list(
            out, [{"to": r} for r in range(self.world)] if self.rank == 0 else None, src=0
        )
        self._same(out, [{"to": self.rank}])

    # -- groups ---------------------------------------------------------------------------------------
    def new_group(self) -> None:
        group = dist.new_group(list(range(self.world)))
        t = torch.ones(2, device=self.dev)
        dist.all_reduce(t, group=group)
        self._check(t, float(self.world))

    def new_subgroups(self) -> None:
        size = 2 if self.world % 2 == 0 else 1
        mine, _ = dist.new_subgroups(size)
        t = torch.ones(1, device=self.dev)
        dist.all_reduce(t, group=mine)
        self._check(t, float(size))

    # -- point to point (a ring: send to the next rank, receive from the previous) ----------------------
    def send_recv(self) -> None:
        got = torch.empty(3, device=self.dev)
        mine = torch.full((3,), float(self.rank), device=self.dev)
        if self.rank % 2 == 0:
            dist.send(mine, dst=self.next)
            dist.recv(got, src=self.prev)
        else:
            dist.recv(got, src=self.prev)
            dist.send(mine, dst=self.next)
        self._check(got, float(self.prev))

    def isend_irecv(self) -> None:
        got = torch.empty(3, device=self.dev)
        works = [
            dist.isend(torch.full((3,), float(self.rank), device=self.dev), dst=self.next),
            dist.irecv(got, src=self.prev),
        ]
        for w in works:
            w.wait()
        self._check(got, float(self.prev))

    def batch_isend_irecv(self) -> None:
        got = torch.empty(2, device=self.dev)
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), float(self.rank), device=self.dev), self.next),
            dist.P2POp(dist.irecv, got, self.prev),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        self._check(got, float(self.prev))


def run(device: torch.device, rank: int, world: int) -> dict[str, str | None]:
    """Every call of the table in order on the default group: None where it worked, else the error."""
    outcomes: dict[str, str | None] = {}
    for name, call in Table(device, rank, world).calls().items():
        try:
            call()
            outcomes[name] = None
        except Exception as e:  # noqa: BLE001 - the outcome is the finding
            outcomes[name] = f"{type(e).__name__}: {e}"
    return outcomes


def expected(world: int) -> dict[str, str | None]:
    """What TorchTPU does (on the chip at world size 1; with a peer, point to point works as well): None
    for a call that works, else words its error contains."""
    want: dict[str, str | None] = dict.fromkeys(Table(torch.device("cpu"), 0, world).calls())
    want["all_reduce of a host tensor"] = HOST_TENSOR
    if world == 1:
        want["send/recv"] = SELF_PEER
    return want


def mismatches(outcomes: dict[str, str | None], world: int) -> dict[str, tuple[str | None, str | None]]:
    """{call: (expected, got)} for each call whose outcome differs from `expected(world)`."""
    want = expected(world)
    bad: dict[str, tuple[str | None, str | None]] = {}
    for name in want.keys() | outcomes.keys():
        w, g = want.get(name), outcomes.get(name, "missing")
        if (w is None and g is not None) or (w is not None and (g is None or w not in g)):
            bad[name] = (w, g)
    return bad

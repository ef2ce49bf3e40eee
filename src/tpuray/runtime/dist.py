"""``tpu_dist`` for the emulated device: a Python ProcessGroup that runs gloo on the same storage.

Every collective unwraps emulated tpu tensors to the CPU tensors that hold their data (no copies) and
calls the matching gloo operation, which runs asynchronously on gloo's threads. The returned Work
completes when gloo does; its future's value is the caller's own tensors (tpu tensors stay tpu
tensors), which is what DDP's reducer and communication hooks read.

ReduceOp.AVG: gloo has no AVG, so AVG is a SUM followed by an in-place division by the group size
(floating-point tensors only, like NCCL). Everything else maps one to one onto gloo.

Registered as TorchTPU 0.2.0 registers its own (`torch_tpu/_loader.py`): the backends "tpu" and
"tpu_dist" for the tpu device alone, and "tpu" as that device's default backend. So torch's object
collectives (all_gather_object, broadcast_object_list, ...) and barrier pick the tpu device, as on a
real slice, and a host tensor fails with the words it fails with there.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future  # type: ignore[attr-defined]

from tpuray.runtime.device import UNWRAPPED_COLLECTIVE, local_tensor

BACKEND_NAME = "tpu_dist"
BACKEND_NAMES = ("tpu", BACKEND_NAME)  # TorchTPU registers both, with the same creator
DEVICES = ["tpu"]  # what TorchTPU registers them for (not the host: it refuses host tensors)

# TorchTPU's default group has no backend for the host, so torch's dispatch refuses a host tensor with
# these words (seen on a TPU v5e: tests/real_tpu/test_dist_table.py); the emulation says the same.
HOST_TENSOR_ERROR = "No backend type associated with device type cpu"

_ReduceOp = dist.ReduceOp


def _one(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding tpu tensor `t`'s data. A host tensor the caller passed itself is refused
    with TorchTPU's words (HOST_TENSOR_ERROR), so that code which runs here does not fail on a real slice;
    this module's own dispatch hands the group the CPU tensors of tpu tensors it unwrapped
    (`UNWRAPPED_COLLECTIVE`), which are taken."""
    if t.device.type != "tpu" and not UNWRAPPED_COLLECTIVE.get():
        raise RuntimeError(
            f"{HOST_TENSOR_ERROR.replace('cpu', t.device.type)} (tpu_dist takes only tensors on the tpu "
            "device, as TorchTPU's does; host tensors need a gloo group: dist.new_group(backend='gloo'))"
        )
    return local_tensor(t)


def _loc(tensors):
    return [_one(t) for t in tensors]


def _is_avg(op) -> bool:
    return op == _ReduceOp.AVG


class TpuDistProcessGroup(dist.ProcessGroup):
    """The emulated ``tpu_dist`` process group (gloo underneath, tensors unwrapped in place)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._size = size
        self._group_name = ""
        self._group_desc = ""
        self._gloo: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(store, rank, size, timeout)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group serves, which torch's object collectives and barrier read: the tpu
        device alone, as TorchTPU's groups (a Python group has no registered backends to list)."""
        return [torch.device(d) for d in DEVICES]

    # The C++ defaults read these from a registered C++ backend, which a Python group has none of.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"TpuDistProcessGroup(rank={self.rank()}, size={self.size()}, EMULATED on CPU via gloo)"

    # ------------------------------------------------------------------ helpers
    def _live(self) -> dist.ProcessGroupGloo:
        if self._gloo is None:
            raise RuntimeError("this tpu_dist process group was shut down (destroy_process_group)")
        return self._gloo

    def _done(self, work, result, post=None):
        """A Work whose future yields ``result`` (the caller's tensors) once gloo's work completes.

        Always a C++ Work (``_create_work_from_future``): a Python Work subclass handed to C++ callers
        (DDP, functional collectives) can be garbage-collected while they still hold it.
        """

        def finish(fut):
            fut.value()  # re-raises a gloo failure
            if post is not None:
                post()
            return result

        try:
            fut = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter works have no future: complete it here
            work.wait()
            fut = torch.futures.Future()
            fut.set_result(None)
        return _create_work_from_future(fut.then(finish))

    def _reduce_opts(self, opts, cls, tensors):
        """(gloo options, post-processing) for a reducing collective; AVG becomes SUM + divide."""
        if not _is_avg(opts.reduceOp):
            return opts, None
        for t in tensors:
            if not t.is_floating_point() and not t.is_complex():
                raise ValueError(f"ReduceOp.AVG needs floating-point tensors on tpu_dist, got {t.dtype}")
        new = cls()
        new.reduceOp = _ReduceOp.SUM
        new.timeout = opts.timeout
        for attr in ("rootRank", "rootTensor", "asyncOp"):
            if hasattr(opts, attr):
                setattr(new, attr, getattr(opts, attr))
        size = self._size

        def post():
            for t in tensors:
                t.div_(size)

        return new, post

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None):
        if opts is None or isinstance(opts, _ReduceOp) or isinstance(opts, _ReduceOp.RedOpType):
            op = opts
            opts = dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        local = _loc(tensors)
        gopts, post = self._reduce_opts(opts, dist.AllreduceOptions, local)
        return self._done(self._live().allreduce(local, gopts), tensors, post)

    def allreduce_coalesced(self, tensors, opts):
        local = _loc(tensors)
        gopts, post = self._reduce_opts(opts, dist.AllreduceCoalescedOptions, local)
        return self._done(self._live().allreduce_coalesced(local, gopts), tensors, post)

    def reduce(self, tensors, opts):
        local = _loc(tensors)
        gopts, post = self._reduce_opts(opts, dist.ReduceOptions, local)
        if post is not None and self.rank() != opts.rootRank:
            post = None
        return self._done(self._live().reduce(local, gopts), tensors, post)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out = _loc(output_tensors)
        gopts, post = self._reduce_opts(opts, dist.ReduceScatterOptions, out)
        inp = [_loc(ts) for ts in input_tensors]
        return self._done(self._live().reduce_scatter(out, inp, gopts), output_tensors, post)

    def _reduce_scatter_base(self, output, input, opts):
        out = _one(output)
        gopts, post = self._reduce_opts(opts, dist.ReduceScatterOptions, [out])
        work = self._live()._reduce_scatter_base(out, _one(input), gopts)
        return self._done(work, [output], post)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, outputs)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts):
        return self._done(self._live().broadcast(_loc(tensors), opts), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        out = [_loc(ts) for ts in output_tensors]
        work = self._live().allgather(out, _loc(input_tensors), opts)
        return self._done(work, output_tensors)

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        work = self._live()._allgather_base(_one(output), _one(input), opts)
        return self._done(work, [output])

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        out = [_loc(ts) for ts in output_lists]
        work = self._live().allgather_coalesced(out, _loc(input_tensors), opts)
        return self._done(work, output_lists)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, outputs)

    def gather(self, output_tensors, input_tensors, opts):
        out = [_loc(ts) for ts in output_tensors]
        work = self._live().gather(out, _loc(input_tensors), opts)
        return self._done(work, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        inp = [_loc(ts) for ts in input_tensors]
        work = self._live().scatter(_loc(output_tensors), inp, opts)
        return self._done(work, output_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        work = self._live().alltoall_base(
            _one(output), _one(input), output_split_sizes, input_split_sizes, opts
        )
        return self._done(work, [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        # gloo's list alltoall is not implemented; exchange the pieces point to point instead.
        opts = opts if opts is not None else dist.AllToAllOptions()
        out, inp = _loc(output_tensors), _loc(input_tensors)
        me = self.rank()
        out[me].copy_(inp[me])
        works = []
        for peer in range(self._size):
            if peer != me:
                works.append(self._live().send([inp[peer].contiguous()], peer, 7))
                works.append(self._live().recv([out[peer]], peer, 7))
        for w in works:
            w.wait()
        fut = torch.futures.Future()
        fut.set_result(output_tensors)
        return _create_work_from_future(fut)

    def barrier(self, opts=None):
        return self._live().barrier(opts if opts is not None else dist.BarrierOptions())

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dst_rank, tag):
        return self._live().send(_loc(tensors), dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        return self._live().recv(_loc(tensors), src_rank, tag)

    def recv_anysource(self, tensors, tag):
        return self._live().recv_anysource(_loc(tensors), tag)

    # ------------------------------------------------------------------ misc
    def _all(self, works, result):
        futs = [w.get_future() for w in works]
        return _create_work_from_future(torch.futures.collect_all(futs).then(lambda f: result))

    def shutdown(self) -> None:
        """Stop gloo and drop it here, on the caller's thread (``destroy_process_group``).

        Kept alive past this point (a DDP model still holds this group), gloo would be destroyed at
        interpreter exit with its worker threads running: the process aborts ("terminate called
        without an active exception") about one exit in five.
        """
        if self._gloo is not None:
            self._gloo.shutdown()
            self._gloo = None

    def abort(self) -> None:
        if self._gloo is not None:
            self._gloo.abort()
            self._gloo = None


def _create(store, rank, size, timeout):
    return TpuDistProcessGroup(store, rank, size, timeout)


def register_backend() -> None:
    """Register the emulated "tpu" and "tpu_dist" backends for the tpu device, and "tpu" as its default
    backend, as TorchTPU does (replacing the "not available" stub if that is registered)."""
    for name in BACKEND_NAMES:
        dist.Backend.register_backend(name, _create, devices=DEVICES)
    dist.Backend.default_device_backend_map["tpu"] = "tpu"

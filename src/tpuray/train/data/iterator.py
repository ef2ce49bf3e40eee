"""`TrainDataIterator`: the `ray.data.DataIterator` that `tpuray.train.get_dataset_shard()` returns.

It forwards to Ray Data's own iterator (a streaming split or a whole-dataset iterator); the one
difference is `iter_torch_batches(device="auto")` (the default), which means tpuray's `get_device()` (the
`tpu` device on TPU workers), as `device="auto"` means `ray.train.torch.get_device()` in Ray Train.
Imported lazily: it loads ray.data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ray.data import DataIterator
from ray.data.context import DataContext


class TrainDataIterator(DataIterator):
    def __init__(self, inner: DataIterator) -> None:
        self._inner = inner

    def _to_ref_bundle_iterator(self) -> Any:
        return self._inner._to_ref_bundle_iterator()

    def _on_iteration_end(self, executor: Any) -> None:
        self._inner._on_iteration_end(executor)

    def _get_dataset_tag(self) -> Any:
        return self._inner._get_dataset_tag()

    def stats(self) -> str:
        return self._inner.stats()

    def schema(self) -> Any:
        return self._inner.schema()

    def get_context(self) -> DataContext:
        return self._inner.get_context()

    def iter_torch_batches(self, *args: Any, device: Any = "auto", **kwargs: Any) -> Iterable[Any]:
        if isinstance(device, str) and device == "auto":
            from tpuray.train.devices import get_device

            device = get_device()
        return super().iter_torch_batches(*args, device=device, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return repr(self._inner)

"""Ray Data ingestion for tpuray.train: `DataConfig`, the per-attempt split of `TorchTrainer(datasets=...)`
into one shard per worker, and `get_dataset_shard()` in the training loop (mirrors `ray.train`).

    trainer = TorchTrainer(loop, datasets={"train": ds, "val": val_ds},
                           dataset_config=DataConfig(datasets_to_split=["train"]), ...)
    def loop(config):
        shard = tpuray.train.get_dataset_shard("train")       # a ray.data.DataIterator
        for epoch in range(2):
            for batch in shard.iter_torch_batches(batch_size=32):   # on get_device() by default
                ...

As in Ray Train, every dataset named in `datasets_to_split` is cut with
`Dataset.streaming_split(num_workers, equal=True, locality_hints=<worker node ids>)`: worker rank r gets
split r, every split has the same number of rows, and each pass over a split is one epoch (all workers
must iterate the same number of epochs: the split's coordinator starts an epoch when every split asks for
it). Other datasets are given whole to every worker (`Dataset.iterator()`).

The split is made by the driver at the start of every attempt, so a restart after a worker/host failure
gets a fresh split (its coordinator actor is shut down and killed when the attempt ends).

On TPU runs, Ray Data's tasks (reads, `map_batches`, ...) are kept off the TPU hosts: unless the
dataset's `ExecutionOptions.label_selector` is set, tpuray sets one that excludes every TPU host
(`ray.io/accelerator-type` not a TPU type) and, unless `resource_limits.cpu` is set, limits Ray Data to
the CPUs of the nodes that selector matches. Ray Data 2.60 applies that selector to every task and actor
it launches for the dataset.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tpuray.constants import ACCELERATOR_LABEL, TPU_RESOURCE
from tpuray.train.session import require_session
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from ray.data import DataIterator, ExecutionOptions
    from ray.data.context import DataContext

logger = logging.getLogger("tpuray.train")

SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class DataConfig:
    """How `TorchTrainer(datasets=...)` reaches the workers (mirrors `ray.train.DataConfig`).

    datasets_to_split: "all" (default) or a list of dataset names; each is split into one equal shard
        per worker. Datasets not listed are given whole to every worker.
    execution_options: Ray Data `ExecutionOptions` for every dataset, or a dict of them by dataset name
        (names left out get the defaults). None: the current `DataContext`'s execution options (as Ray
        Train, which copies their resource limits, preserve_order and verbose_progress; tpuray keeps
        their label_selector too).
    enable_shard_locality: pass the workers' node ids to streaming_split as locality hints.
    """

    datasets_to_split: Literal["all"] | list[str] = "all"
    execution_options: ExecutionOptions | dict[str, ExecutionOptions] | None = None
    enable_shard_locality: bool = True

    def __post_init__(self) -> None:
        names = self.datasets_to_split
        if isinstance(names, tuple):
            names = self.datasets_to_split = list(names)
        if names != "all" and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ConfigError(
                f"DataConfig.datasets_to_split={names!r} is invalid: use 'all' or a list of dataset names."
            )
        if not isinstance(self.enable_shard_locality, bool):
            raise ConfigError(
                f"DataConfig.enable_shard_locality={self.enable_shard_locality!r} is invalid: use True or False."
            )
        options = self.execution_options
        if options is None:
            return
        from ray.data import ExecutionOptions

        if isinstance(options, dict):
            for key, value in options.items():
                if not isinstance(key, str) or not isinstance(value, ExecutionOptions):
                    raise ConfigError(
                        f"DataConfig.execution_options[{key!r}]={value!r} is invalid: map dataset names to "
                        "ray.data.ExecutionOptions."
                    )
        elif not isinstance(options, ExecutionOptions):
            raise ConfigError(
                f"DataConfig.execution_options={options!r} is invalid: use a ray.data.ExecutionOptions, a "
                "dict of them by dataset name, or None."
            )

    def split_names(self, names: Iterable[str]) -> set[str]:
        return set(names) if self.datasets_to_split == "all" else set(self.datasets_to_split)

    def check_names(self, names: Iterable[str]) -> None:
        """ConfigError if datasets_to_split or execution_options name a dataset that is not passed."""
        known = sorted(names)
        listed = [] if self.datasets_to_split == "all" else list(self.datasets_to_split)
        if isinstance(self.execution_options, dict):
            listed += list(self.execution_options)
        unknown = sorted({n for n in listed if n not in known})
        if unknown:
            raise ConfigError(
                f"DataConfig names dataset(s) {unknown!r} that are not in TorchTrainer(datasets=...); "
                f"valid: {known!r}."
            )

    def options_for(self, name: str, ctx: DataContext | None = None) -> ExecutionOptions:
        """A copy of the execution options for one dataset; when none were given, those of `ctx` (the
        DataContext captured when the trainer was made; default: the current one)."""
        options = self.execution_options
        if isinstance(options, dict):
            options = options.get(name)
        if options is None:
            from ray.data.context import DataContext

            options = (ctx or DataContext.get_current()).execution_options
        return copy.deepcopy(options)


@dataclass
class WorkerShards:
    """What one worker receives: its iterator per dataset name, and the driver's Ray DataContext."""

    iterators: dict[str, DataIterator]
    data_context: DataContext

    def install(self) -> dict[str, DataIterator]:
        """On the worker: make the driver's DataContext current; the iterators get_dataset_shard() hands
        out (their iter_torch_batches() defaults to get_device())."""
        from ray.data.context import DataContext

        from tpuray.train.data.iterator import TrainDataIterator

        DataContext._set_current(self.data_context)
        return {name: TrainDataIterator(it) for name, it in self.iterators.items()}


class AttemptShards:
    """The shards of one attempt; `shutdown()` stops and kills the streaming_split coordinators."""

    def __init__(self, per_rank: list[dict[str, DataIterator]], coordinators: list, ctx: DataContext):
        self.per_rank = per_rank
        self.coordinators = coordinators
        self.data_context = ctx

    def for_rank(self, rank: int) -> WorkerShards:
        return WorkerShards(self.per_rank[rank], self.data_context)

    def shutdown(self) -> None:
        import ray

        coordinators, self.coordinators = self.coordinators, []
        if not coordinators or not ray.is_initialized():
            return
        refs = [c.shutdown_executor.remote() for c in coordinators]
        ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        for coordinator in coordinators:
            try:
                ray.kill(coordinator, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass


class TrainDatasets:
    """`TorchTrainer(datasets=..., dataset_config=...)`, validated at construction; split per attempt."""

    def __init__(self, datasets: Any, config: Any) -> None:
        if datasets is None:
            raise ConfigError(
                f"dataset_config={config!r} was given without datasets: pass TorchTrainer(datasets={{name: "
                "ray.data.Dataset}}) too, or drop dataset_config."
            )
        if not isinstance(datasets, dict):
            raise ConfigError(
                f"datasets={datasets!r} is invalid: use a dict of name -> ray.data.Dataset, e.g. "
                "{'train': ds}."
            )
        from ray.data import Dataset
        from ray.data.context import DataContext

        for name, ds in datasets.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"datasets key {name!r} is invalid: dataset names are non-empty strings.")
            if not isinstance(ds, Dataset) and not callable(ds):
                raise ConfigError(
                    f"datasets[{name!r}]={ds!r} is invalid: use a ray.data.Dataset (or a function "
                    "returning one, called at the start of every attempt)."
                )
        if config is None:
            config = DataConfig()
        elif not isinstance(config, DataConfig):
            raise TypeError(
                f"dataset_config={config!r} must be a tpuray.train.DataConfig (import it from tpuray.train, "
                "not ray.train)"
            )
        config.check_names(datasets)
        self.datasets = dict(datasets)
        self.config = config
        # Captured here and installed on every worker, as Ray Train does.
        self.data_context = copy.deepcopy(DataContext.get_current())

    def split(self, node_ids: list[str], keep_off_tpu: bool) -> AttemptShards:
        """Cut the datasets for one attempt of len(node_ids) workers (rank order)."""
        from ray.data import Dataset
        from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

        world = len(node_ids)
        per_rank: list[dict[str, DataIterator]] = [{} for _ in range(world)]
        coordinators: list = []
        split = self.config.split_names(self.datasets)
        hints = node_ids if self.config.enable_shard_locality else None
        try:
            for name, source in self.datasets.items():
                ds = source() if not isinstance(source, Dataset) else source
                if not isinstance(ds, Dataset):
                    raise ConfigError(
                        f"datasets[{name!r}] returned {ds!r}: the function must return a ray.data.Dataset."
                    )
                ds = Dataset.copy(ds, _deep_copy=True)  # its own DataContext: the user's stays as it is
                if ds.name is None:
                    ds.set_name(name)
                options = self.config.options_for(name, self.data_context)
                if keep_off_tpu:
                    _keep_off_tpu_hosts(name, options)
                ds.context.execution_options = options
                if name in split:
                    iterators = ds.streaming_split(world, equal=True, locality_hints=hints)
                    for rank, it in enumerate(iterators):
                        per_rank[rank][name] = it
                    coord = getattr(iterators[0], "_coord_actor", None)
                    if isinstance(iterators[0], StreamSplitDataIterator) and coord is not None:
                        coordinators.append(coord)
                else:
                    for rank in range(world):
                        per_rank[rank][name] = ds.iterator()
        except BaseException:
            AttemptShards([], coordinators, self.data_context).shutdown()
            raise
        return AttemptShards(per_rank, coordinators, self.data_context)


def tpu_accelerator_types(nodes: list[dict[str, Any]]) -> list[str]:
    """Ray accelerator-type labels of TPU hosts: every generation tpuray knows + any TPU node alive in
    `nodes` (`ray.nodes()`)."""
    from tpuray.topology.catalog import GENERATIONS

    types = {g.accelerator_type for g in GENERATIONS}
    for node in nodes:
        if node.get("Alive") and node.get("Resources", {}).get(TPU_RESOURCE, 0) > 0:
            label = (node.get("Labels") or {}).get(ACCELERATOR_LABEL)
            if label:
                types.add(label)
    return sorted(types)


def _keep_off_tpu_hosts(name: str, options: ExecutionOptions) -> None:
    """Constrain Ray Data's tasks for one dataset to nodes that are not TPU hosts (unless the user set
    a label_selector), and its CPU budget to those nodes' CPUs (unless the user set resource_limits.cpu)."""
    import math

    import ray

    if options.label_selector:
        return
    nodes = ray.nodes()
    types = tpu_accelerator_types(nodes)
    options.label_selector = {ACCELERATOR_LABEL: f"!in({','.join(types)})"}
    cpus = 0.0
    for node in nodes:
        res = node.get("Resources", {})
        label = (node.get("Labels") or {}).get(ACCELERATOR_LABEL)
        if node.get("Alive") and res.get(TPU_RESOURCE, 0) == 0 and label not in types:
            cpus += res.get("CPU", 0)
    if cpus == 0:
        logger.warning(
            "tpuray.train: dataset %r: Ray Data's tasks are kept off the TPU hosts (label_selector %s), but no "
            "alive node without TPUs has CPUs; they wait until one joins. Add a CPU node, or set "
            "DataConfig(execution_options=ExecutionOptions(label_selector=...)) to choose where they run.",
            name,
            options.label_selector,
        )
        return
    if math.isinf(options.resource_limits.cpu):
        options.resource_limits = options.resource_limits.copy(cpu=cpus)


# ---- worker side --------------------------------------------------------------------------------------
def get_dataset_shard(dataset_name: str | None = None) -> DataIterator:
    """This worker's `ray.data.DataIterator` for `TorchTrainer(datasets={dataset_name: ...})` (mirrors
    `ray.train.get_dataset_shard`). `iter_torch_batches()` puts batches on `get_device()` by default
    (device="auto", as in Ray Train). With no name, the only dataset (an error if there are several)."""
    return require_session("get_dataset_shard").dataset_shard(dataset_name)

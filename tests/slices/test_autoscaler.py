"""The slice autoscaler's published contract (tpuray.slices.autoscaler): node types round-trip through
their JSON form, and nothing is published where no Ray connection or no slice autoscaler is. What the
emulator's autoscaler publishes through it, read back: tests/emulator/test_autoscale.py."""

from __future__ import annotations

import json

from tpuray.slices.autoscaler import (
    NODE_TYPES_KEY,
    SliceNodeType,
    encode,
    published_node_types,
    published_slices,
)

V6E = SliceNodeType("tpu-v6e-16", "TPU-V6E", "4x4", "v6e-16", max_slices=2)


def test_a_node_type_round_trips_through_its_published_json() -> None:
    published = {V6E.name: V6E.to_json()}
    assert json.loads(encode(published)) == {
        "tpu-v6e-16": {
            "accelerator_type": "TPU-V6E",
            "topology": "4x4",
            "pod_type": "v6e-16",
            "max_slices": 2,
        }
    }
    (back,) = [SliceNodeType.from_json(n, v) for n, v in json.loads(encode(published)).items()]
    assert back == V6E
    assert V6E.describe() == "tpu-v6e-16 (TPU-V6E 4x4, at most 2)"
    assert NODE_TYPES_KEY.startswith("emulator/")


def test_nothing_is_published_without_a_slice_autoscaler() -> None:
    """Whether this process has no Ray connection or is connected to a cluster started without one."""
    assert published_node_types() is None and published_slices() == {}

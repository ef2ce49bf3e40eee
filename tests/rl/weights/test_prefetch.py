"""An update's tensors sent to the device a window ahead of the loader (tpuray.rl.weights.prefetch): the
same names in the same order, each on the device, never more than the window plus one tensor sent and
not yet taken."""

from __future__ import annotations

import pytest
import torch

from tpuray.rl.weights.prefetch import prefetched


def sizes_state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate([10, 300, 5, 40, 40, 1000, 1, 64])}


def test_prefetched_keeps_the_order_and_bounds_what_is_ahead():
    state = sizes_state()
    pulled: list[str] = []

    def source():
        for name, t in state.items():
            pulled.append(name)
            yield name, t

    window = 400  # bytes: float32, so 100 elements
    largest = max(t.numel() * t.element_size() for t in state.values())
    seen = []
    for name, t in prefetched(source(), torch.device("meta"), window_bytes=window):
        assert t.device.type == "meta" and t.shape == state[name].shape  # sent to the device given
        seen.append(name)
        ahead = [n for n in pulled if n not in seen]  # sent, not yet taken (the one taken now excluded)
        assert sum(state[n].numel() * state[n].element_size() for n in ahead) < window + largest
    assert seen == list(state) == pulled


def test_prefetched_on_the_host_hands_each_tensor_on_as_it_is():
    state = sizes_state()
    out = dict(prefetched(iter(state.items()), torch.device("cpu")))
    assert list(out) == list(state) and all(out[n] is state[n] for n in state)  # no copy on a CPU
    assert list(prefetched(iter([]), torch.device("cpu"))) == []


def test_prefetched_refuses_a_window_of_no_bytes():
    with pytest.raises(ValueError, match=r"window_bytes=0 is invalid; valid: a positive number of bytes"):
        list(prefetched(iter(sizes_state().items()), torch.device("cpu"), window_bytes=0))

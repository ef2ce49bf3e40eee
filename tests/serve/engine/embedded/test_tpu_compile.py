"""The engine's compile backends off a TPU: the donating backend needs torch_tpu and says so at
construction; the default backend per device (the on-chip checks are tests/real_tpu/test_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _util import WITHOUT_TORCH_TPU
from tpuray.serve.llm.engine.embedded.runner import ModelRunner, default_backend
from tpuray.serve.llm.engine.embedded.tpu_compile import aot_compilers, lookup

pytestmark = WITHOUT_TORCH_TPU


def test_donating_backend_without_torch_tpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ImportError, match=r"compile_backend='tpu-donate' needs torch_tpu 0\.2\.0"):
        lookup("tpu-donate")
    with pytest.raises(
        ImportError, match="compile_backend='tpu-donate'"
    ):  # at construction, not the 1st step
        ModelRunner(
            tiny_model_dir, max_num_seqs=2, max_model_len=32, compile=True, compile_backend="tpu-donate"
        )


def test_default_backend_per_device():
    assert default_backend(torch.device("cpu"), 1) == "inductor"
    tpu = SimpleNamespace(type="tpu")  # the device's type is all it reads; no runtime activated here
    assert default_backend(tpu, 4) == "tpu"  # tensor parallel: programs with collectives
    assert lookup("eager") is not None  # any Dynamo backend name passes through


class _InTheBackground:
    """A forward program as torch_tpu's AsyncCompiledArtifact hands it out: its class attributes are
    read without waiting; any other attribute waits for the background compilation (counted here)."""

    _boxed_call = True
    _fx_graph_cache_key = None
    _is_fallback = False
    waits = 0

    def __init__(self, graph):
        self.graph, self._boxed_call = graph, True  # as the executable it resolves to holds it

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        type(self).waits += 1
        raise AttributeError(name)

    def __call__(self, args):
        return self.graph(*args)


def test_a_program_compiled_in_the_background_is_not_waited_for_by_aot_autograd():
    from torch._dynamo.backends.common import aot_autograd

    def forward(graph, inputs):
        return _InTheBackground(graph)

    def backend(gm, example_inputs):
        return aot_autograd(**aot_compilers(object, forward, forward))(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(lambda x: (x * 2 + 1).sum(), backend=backend, fullgraph=True)
    with torch.no_grad():
        assert step(torch.ones(4)).item() == 12.0
    assert _InTheBackground.waits == 0  # torch's disable() looked nothing up on it

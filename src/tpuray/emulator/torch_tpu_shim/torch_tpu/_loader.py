"""`torch_tpu._loader.load()`: make the emulated `tpu` device and `tpu_dist` backend available."""


def load() -> None:
    """Idempotent: tpuray.runtime.activate() registers the emulation once per process."""
    import torch.distributed as dist

    from tpuray import runtime

    runtime.activate()
    if "tpu_dist" not in dist.Backend.backend_list:
        raise RuntimeError("tpuray's emulated torch_tpu could not register the tpu_dist backend")

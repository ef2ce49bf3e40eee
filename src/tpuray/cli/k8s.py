"""`tpuray k8s`: print a KubeRay RayCluster / RayJob / RayService for GKE TPU node pools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tpuray.cli import UsageError
from tpuray.cli.flags import add_num_slices, add_slice_shape

if TYPE_CHECKING:
    from tpuray.k8s.autoscale import AutoscaleConfig

EPILOG = """\
examples:
  tpuray k8s --accelerator-type TPU-V6E --topology 4x4 | kubectl apply -f -
  tpuray k8s -a TPU-V6E -t 4x4 --num-slices 2 --image REGISTRY/tpuray:latest -o cluster.yaml
  tpuray k8s -a v5p -t 2x2x2 --kind rayjob --entrypoint "python train.py" --pip "tpuray[tpu]"
  tpuray k8s -a TPU-V6E -t 2x4 --kind rayservice --model /models/my-llm
  tpuray k8s -a TPU-V6E -t 4x4 --kind rayservice --serve-config serve.yaml
  tpuray k8s -a TPU-V6E -t 4x4 --autoscale --min-slices 0 --max-slices 4 --idle-timeout-s 300

One worker group, one replica per slice, numOfHosts pods per replica (one per TPU host, each with
all its chips as google.com/tpu), pinned by the cloud.google.com/gke-tpu-accelerator and
cloud.google.com/gke-tpu-topology node selectors. Needs the KubeRay operator and its TPU webhook
(GKE's Ray add-on installs both). See docs/k8s.md.

--autoscale turns on Ray's in-tree autoscaler (enableInTreeAutoscaling, autoscalerOptions): it adds and
removes whole slices, one worker-group replica of numOfHosts pods each, between --min-slices and
--max-slices (counted in slices, not hosts; --num-slices is the initial count, default --min-slices).
GKE must supply the nodes: TPU node pools with autoscaling or node auto-provisioning. See
docs/autoscaling-k8s.md.
"""
AUTOSCALE_FLAGS = ("min_slices", "max_slices", "idle_timeout_s", "upscaling_mode", "autoscaler_version")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "k8s",
        help="print KubeRay manifests (RayCluster/RayJob/RayService) for GKE TPU node pools",
        description="Write a KubeRay manifest for TPU slices on GKE, checked against the topology model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_slice_shape(p)
    add_num_slices(
        p,
        default=None,
        help="identical slices = worker replicas (default 1; with --autoscale the initial count, default "
        "--min-slices)",
    )
    p.add_argument(
        "--kind", default="raycluster", help="raycluster (default), rayjob or rayservice (case-insensitive)"
    )
    p.add_argument("--name", default="", help="resource name (default tpuray-<pod type>)")
    p.add_argument("--namespace", default=None, help="metadata.namespace (default: none)")
    p.add_argument("--image", default="", help="container image with tpuray[tpu] (default rayproject/ray)")
    p.add_argument("--ray-version", default="", help="spec.rayVersion (default: installed Ray)")
    p.add_argument("--head-cpu", default="4", help="head pod CPU (default 4)")
    p.add_argument("--head-memory", default="16Gi", help="head pod memory (default 16Gi)")
    p.add_argument("--worker-cpu", default="8", help="CPU per TPU host pod (default 8)")
    p.add_argument("--worker-memory", default="32Gi", help="memory per TPU host pod (default 32Gi)")
    _add_job_args(p)
    p.add_argument(
        "--validate",
        action="store_true",
        help="also check against KubeRay's CRD schemas (folder in $TPURAY_KUBERAY_CRDS; see docs/k8s.md)",
    )
    _add_capacity_args(p)
    _add_autoscale_args(p)
    p.add_argument("--output", "-o", metavar="FILE", default=None, help="write to FILE instead of stdout")
    p.set_defaults(func=run)


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """What a RayJob runs and a RayService serves."""
    p.add_argument("--entrypoint", default=None, help="rayjob: command the job runs")
    p.add_argument(
        "--pip", action="append", default=[], metavar="PKG", help="rayjob/rayservice: runtime_env pip package"
    )
    p.add_argument(
        "--model",
        default=None,
        help="rayservice: model directory (inside the image) served by tpuray.serve.llm",
    )
    p.add_argument(
        "--serve-config",
        metavar="FILE",
        default=None,
        help="rayservice: YAML with a Ray Serve config (applications) or build_openai_app args (llm_configs)",
    )


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    """Which GKE capacity the TPU hosts run on."""
    capacity = p.add_mutually_exclusive_group()
    capacity.add_argument(
        "--spot",
        action="store_true",
        help="TPU hosts on GKE spot VMs (nodeSelector cloud.google.com/gke-spot=true + its toleration); "
        "tpuray.train and tpuray.serve.llm handle their preemption notices",
    )
    capacity.add_argument(
        "--reservation",
        metavar="NAME",
        default=None,
        help="TPU hosts on the GKE reservation NAME (cloud.google.com/reservation-name, affinity specific)",
    )


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    from tpuray.k8s.autoscale import AUTOSCALER_VERSIONS, UPSCALING_MODES

    g = p.add_argument_group("autoscaling (Ray's in-tree autoscaler; counts are whole slices)")
    g.add_argument(
        "--autoscale",
        action="store_true",
        help="enableInTreeAutoscaling: Ray's autoscaler adds/removes whole slices for pending demand",
    )
    g.add_argument(
        "--min-slices", type=int, default=None, metavar="N", help="minReplicas in slices (default 0)"
    )
    g.add_argument(
        "--max-slices", type=int, default=None, metavar="N", help="maxReplicas in slices, >= 1 (default 1)"
    )
    g.add_argument(
        "--idle-timeout-s",
        type=int,
        default=None,
        metavar="S",
        help="autoscalerOptions.idleTimeoutSeconds: a slice idle this long is removed (Ray's default 60)",
    )
    g.add_argument(
        "--upscaling-mode",
        default=None,
        metavar="MODE",
        help=f"autoscalerOptions.upscalingMode: {', '.join(UPSCALING_MODES)} (case-insensitive; "
        "Ray's default: not rate-limited)",
    )
    g.add_argument(
        "--autoscaler-version",
        default=None,
        metavar="VERSION",
        help=f"autoscalerOptions.version: {' or '.join(AUTOSCALER_VERSIONS)} (default v2; "
        "v1 only for single-host slices)",
    )


def _autoscale_config(args: argparse.Namespace) -> tuple[int, AutoscaleConfig | None]:
    """(initial slices, autoscale config); autoscaling flags without --autoscale are refused by name."""
    from tpuray.k8s.autoscale import AutoscaleConfig

    if not args.autoscale:
        given = [f"--{f.replace('_', '-')}" for f in AUTOSCALE_FLAGS if getattr(args, f) is not None]
        if given:
            raise UsageError(
                f"{', '.join(given)} need --autoscale (they set the autoscaler's bounds and options)"
            )
        return (1 if args.num_slices is None else args.num_slices), None
    scale = AutoscaleConfig(
        min_slices=0 if args.min_slices is None else args.min_slices,
        max_slices=1 if args.max_slices is None else args.max_slices,
        idle_timeout_s=args.idle_timeout_s,
        upscaling_mode=args.upscaling_mode,
        version=args.autoscaler_version or "v2",
    )
    return (scale.min_slices if args.num_slices is None else args.num_slices), scale


def _load_serve_config(path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--serve-config {path!r}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise UsageError(f"--serve-config {path!r} is not valid YAML: {str(e).splitlines()[0]}") from e
    if not isinstance(data, dict):
        raise UsageError(f"--serve-config {path!r} must hold a mapping, got {type(data).__name__}")
    return data


def run(args: argparse.Namespace) -> int:
    from tpuray.k8s import K8sConfig, build_manifest, render

    num_slices, autoscale = _autoscale_config(args)
    cfg = K8sConfig(
        accelerator_type=args.accelerator_type,
        topology=args.topology,
        num_slices=num_slices,
        kind=args.kind,
        name=args.name,
        namespace=args.namespace,
        image=args.image,
        ray_version=args.ray_version,
        head_cpu=args.head_cpu,
        head_memory=args.head_memory,
        worker_cpu=args.worker_cpu,
        worker_memory=args.worker_memory,
        entrypoint=args.entrypoint,
        runtime_env={"pip": list(args.pip)} if args.pip else None,
        serve_config=_load_serve_config(args.serve_config) if args.serve_config else None,
        model=args.model,
        spot=args.spot,
        reservation=args.reservation,
        autoscale=autoscale,
    )
    if args.validate:
        from tpuray.k8s.schema import validate

        try:
            validate(build_manifest(cfg))
        except (FileNotFoundError, ImportError) as e:
            raise UsageError(f"--validate: {e}") from e
    text = render(cfg)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output!r}: {e.strerror}") from e
        print(f"wrote {args.output}: {cfg.describe()}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

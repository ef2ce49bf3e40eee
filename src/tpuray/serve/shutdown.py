"""Stop Ray Serve without Ray's spurious error line.

`serve.shutdown()` asks Serve's controller to shut down; the controller kills itself at the end of that
call, and since the call may be retried forever (the controller's `max_task_retries=-1`), Ray reports
"(raylet) Task ServeController.graceful_shutdown failed ... killed by `ray.kill`" to the driver on every
clean shutdown. Asking with no retries ends the same way, quietly.
"""

from __future__ import annotations

import logging


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """`serve.shutdown()`, quiet: the controller's graceful shutdown without retries, then Serve's own
    clean-up of this driver's state (whose "controller has died" notes are Serve's INFO lines)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if not ray.is_initialized():
        return
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # Serve is not running
        controller = None
    if controller is not None:
        try:
            ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            pass  # it killed itself: done
        except ray.exceptions.GetTimeoutError:
            logging.getLogger(__name__).warning("Serve's controller did not shut down within %ss", timeout_s)
    serve_logger = logging.getLogger("ray.serve")
    level = serve_logger.level
    serve_logger.setLevel(logging.WARNING)
    try:
        serve.shutdown()
    finally:
        serve_logger.setLevel(level)

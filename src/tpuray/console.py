"""What a long-running command (`tpuray demo`, `tpuray serve`) shows: tpuray's own lines. vLLM's log
lines (in this process and in the engine processes it starts), Ray's driver messages and libraries'
progress bars go to a log file the command names, or to the console with --verbose.

vLLM's lines go through vLLM's own mechanism (`VLLM_LOGGING_CONFIG_PATH`: a logging dictConfig that sends
its `vllm` logger to the file), set in the environment, so processes started from this one log there too.
Ray's `ray.init` reconfigures its driver logger: call `LogFile.capture()` again after it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tpuray.constants import LOG_DIR_ENV

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
RAY_LOGGERS = ("ray", "ray.serve", "ray.train")
VLLM_CONFIG_SUFFIX = ".vllm-logging.json"  # a user's own VLLM_LOGGING_CONFIG_PATH is left alone


def log_dir() -> Path:
    return Path(os.environ.get(LOG_DIR_ENV) or Path.home() / ".tpuray" / "logs")


class LogFile:
    """One command's log file: `capture()` routes third-party output there (idempotent)."""

    def __init__(self, command: str) -> None:
        directory = log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        self._handler = logging.FileHandler(self.path)
        self._handler.setFormatter(logging.Formatter(FORMAT))

    def capture(self) -> LogFile:
        """Send vLLM's logger (here and in child processes), Ray's driver loggers and progress bars of
        Hugging Face libraries to the file. Call before vLLM is imported, and again after ray.init."""
        current = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
        if not current or current.endswith(VLLM_CONFIG_SUFFIX):  # unset, or an earlier LogFile's: ours
            config = self.path.with_suffix(VLLM_CONFIG_SUFFIX)
            config.write_text(json.dumps(self._vllm_config()))
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
        for name in RAY_LOGGERS:
            logger = logging.getLogger(name)
            logger.handlers[:] = [self._handler]
            logger.propagate = False
        return self

    def _vllm_config(self) -> dict:
        return {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": FORMAT}},
            "handlers": {
                "file": {"class": "logging.FileHandler", "filename": str(self.path), "formatter": "plain"}
            },
            "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
        }


def quiet_logs(command: str, verbose: bool) -> LogFile | None:
    """A captured LogFile for `command`, or None with `verbose` (everything stays on the console)."""
    return None if verbose else LogFile(command).capture()

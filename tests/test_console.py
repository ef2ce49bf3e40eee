"""Quiet output: third-party log lines go into the command's log file (tpuray.console)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_log_file_takes_vllms_lines_in_this_process_and_its_children(tmp_path) -> None:
    """vLLM's own logging config (VLLM_LOGGING_CONFIG_PATH) sends its logger to the command's file, in this
    process and in one it starts; Ray's driver messages go there too."""
    code = f"""
import logging, os, subprocess, sys
os.environ["TPURAY_LOG_DIR"] = {str(tmp_path)!r}
from tpuray.console import quiet_logs
logs = quiet_logs("check", verbose=False)
logging.getLogger("ray").warning("a Ray driver message")
import vllm.logger
vllm.logger.init_logger("vllm.check").info("vLLM here")
subprocess.run([sys.executable, "-c", "import vllm.logger; vllm.logger.init_logger('vllm.child').info('vLLM child')"])
print(logs.path)
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_CONFIG_PATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = proc.stdout.strip().splitlines()[-1]
    text = open(path).read()
    assert "a Ray driver message" in text and "vLLM here" in text and "vLLM child" in text
    assert "vLLM" not in proc.stderr and "Ray driver" not in proc.stderr
    assert json.loads(open(path.replace(".log", ".vllm-logging.json")).read())["loggers"]["vllm"]
    assert os.path.dirname(path) == str(tmp_path)

"""`tpuray demo` wiring: config validation, CLI help, and the corpus in the tiny model's chat format.

The demo itself (train on an emulated slice, serve, ask) is the README's main-job command (`make demo`);
its parts are tested end to end in tests/train and tests/serve.
"""

from __future__ import annotations

import pytest

from tpuray.cli import main
from tpuray.demo import QA_PAIRS, DemoConfig, chat_corpus


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="epochs"):
        DemoConfig(epochs=0)
    with pytest.raises(ValueError, match="lr"):
        DemoConfig(lr=0.0)


def test_rl_act_needs_its_slice(capsys) -> None:
    DemoConfig(rl=True)  # the defaults: an emulated v6e 2x2
    with pytest.raises(ValueError, match="rl=True runs GRPO on an emulated TPU-V6E 2x2 slice; got .*'4x4'"):
        DemoConfig(rl=True, topology="4x4")
    with pytest.raises(ValueError, match="rl_iterations"):
        DemoConfig(rl=True, rl_iterations=0)
    assert main(["demo", "--rl", "--topology", "4x4", "--quiet"]) == 2
    assert "TPU-V6E 2x2" in capsys.readouterr().err


def test_bad_topology_is_a_one_line_usage_error(capsys) -> None:
    assert main(["demo", "--topology", "3x3", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "3x3" in err and "2x2" in err and len(err.splitlines()) == 1


def test_help_explains_itself(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "EMULATED" in capsys.readouterr().out


def test_corpus_matches_the_models_chat_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    from tpuray.models import build_tokenizer

    tok = build_tokenizer("".join(chat_corpus()))
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    question, answer = QA_PAIRS[0]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    assert chat_corpus()[0] == f"{prompt}{answer}<|im_end|>\n"

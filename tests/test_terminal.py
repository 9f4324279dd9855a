"""A quiet terminal and clean log files: no carriage-return progress bars in a file, no import-time noise."""

import io
import logging

import pytest
import transformers

from trl_diffusion.trainer import BGPOConfig, DiffusionSFTConfig


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def transformers_warnings():
    """transformers hides the bar when its log level is above warnings, as earlier tests may have left it."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("config_class", [BGPOConfig, DiffusionSFTConfig])
def test_progress_bar_gives_way_to_log_lines_when_stderr_is_a_file(
    config_class, tmp_path, monkeypatch, transformers_warnings
):
    common = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": "none"}
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert config_class(**common).disable_tqdm is True
    assert config_class(**common, disable_tqdm=False).disable_tqdm is False  # an explicit choice is kept
    monkeypatch.setattr("sys.stderr", Terminal())
    assert config_class(**common).disable_tqdm is False  # on a terminal, transformers' default: the bar


def test_bitsandbytes_optional_kernels_notice_is_dropped_and_nothing_else(caplog):
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        logger.warning("a real bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["a real bitsandbytes warning"]

"""The decode programs' XLA compile options from the config."""

from __future__ import annotations

import pytest

from MaxText import pyconfig
from MaxText.inference.compile_options import decode_compiler_options

TINY = "configs/kimi_linear_tiny.yml"


@pytest.mark.parametrize("mode, option", [("serialize", "SERIALIZE"), ("concurrent", "CONCURRENT"), ("lhs", "LHS")])
def test_graph_scheduling_maps_to_the_xla_option(mode, option):
    config = pyconfig.load_config(TINY, {"decode_graph_scheduling": mode})
    assert decode_compiler_options(config) == {"xla_gpu_command_buffer_scheduling_mode": option}


def test_concurrent_is_the_default_and_a_bad_value_is_named():
    assert pyconfig.load_config(TINY).decode_graph_scheduling == "concurrent"
    with pytest.raises(pyconfig.ConfigError, match="decode_graph_scheduling.*'parallel'.*serialize, concurrent, lhs"):
        pyconfig.load_config(TINY, {"decode_graph_scheduling": "parallel"})

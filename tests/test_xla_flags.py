"""MaxText/xla_flags.py: the project's default XLA flags join XLA_FLAGS without overriding the user's."""

from MaxText import xla_flags

CONCURRENT = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


def test_defaults_join_the_users_flags():
    assert xla_flags.with_defaults("") == CONCURRENT
    assert xla_flags.with_defaults("  --xla_gpu_enable_pdl=true ") == "--xla_gpu_enable_pdl=true " + CONCURRENT


def test_a_flag_the_user_set_keeps_its_value():
    serialize = "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE --xla_dump_to=/tmp/d"
    assert xla_flags.with_defaults(serialize) == serialize
    assert xla_flags.with_defaults(CONCURRENT) == CONCURRENT  # not repeated


def test_set_defaults_writes_the_environment():
    environ = {"XLA_FLAGS": "--xla_gpu_enable_pdl=false"}
    assert xla_flags.set_defaults(environ) == "--xla_gpu_enable_pdl=false " + CONCURRENT
    assert environ["XLA_FLAGS"] == "--xla_gpu_enable_pdl=false " + CONCURRENT
    assert xla_flags.set_defaults({}) == CONCURRENT

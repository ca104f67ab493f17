"""producer_tools.common: command-line values."""

from producer_tools.common import parse_size


def test_parse_size():
    assert parse_size("900KiB") == 921600 and parse_size("1MiB") == 1 << 20 and parse_size("123") == 123

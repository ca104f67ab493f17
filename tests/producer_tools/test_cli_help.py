"""`alpamayo-producer`: every subcommand and flag has a description, every subcommand an example."""

import argparse

from producer_tools.cli import build_parser


def _commands(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def test_every_subcommand_and_flag_is_described_with_an_example():
    undescribed, no_example = [], []
    for path, parser in _commands(build_parser()):
        undescribed += [f"{' '.join(path)} {a.dest}" for a in parser._actions
                        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
        if path and f"alpamayo-producer {' '.join(path)}" not in (parser.epilog or ""):
            no_example.append(" ".join(path))
        if path:
            assert parser.description, path
    assert undescribed == [] and no_example == []

"""Flags are generated from the config dataclasses: every field of a command's configs is a
flag whose default is the field's, the flag follows what the field declares (choices or any
text), and the default model is written once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

import tokenweir
from tokenweir.cli import build_parser, main
from tokenweir.cli.commands import COMMANDS
from tokenweir.cli.flags import add_config_flags, default_namespace, flag_names
from tokenweir.config import (CONFIG_CLASSES, DEFAULT_MODEL, CalibrateConfig, ModelConfig,
                              SchedulerConfig, _f, engine_kwargs)

PACKAGE = Path(tokenweir.__file__).parent


def _minimal_argv(command) -> list[str]:
    """The command's path plus its required flags."""
    argv = list(command.path)
    for owner in command.configs:
        for field in dataclasses.fields(owner):
            if field.metadata.get("required"):
                argv += [flag_names(field)[0], "x"]
            elif _must_be_given(field):
                argv += ["x"]  # a positional of one or more values
    return argv


def _must_be_given(field) -> bool:
    return bool(field.metadata.get("required")) or field.metadata.get("nargs") == "+"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c.path))
def test_every_config_field_is_a_flag_with_the_field_default(command):
    args = build_parser().parse_args(_minimal_argv(command))
    expected = vars(default_namespace(*command.configs))
    for name, default in expected.items():
        field_required = any(f.name == name and _must_be_given(f)
                             for owner in command.configs for f in dataclasses.fields(owner))
        if not field_required:
            assert getattr(args, name) == default, (command.path, name)
    if command.engine_flags:
        # engine flags the user did not give stay unset: the engine keeps its own defaults
        assert engine_kwargs(args) == {}
        engine = {f.name for owner in CONFIG_CLASSES for f in dataclasses.fields(owner)}
        dests = {a.dest for a in _leaf(command.path)._actions}
        assert engine - set(command.engine_exclude) <= dests


def _leaf(path):
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return parser


def test_engine_flags_given_reach_engine_kwargs():
    args = build_parser().parse_args(["generate", "--max-num-seqs", "3",
                                      "--no-enable-prefix-caching", "--dtype", "float32"])
    assert engine_kwargs(args) == {"max_num_seqs": 3, "enable_prefix_caching": False,
                                   "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class _PluginConfig:
    """a config like the scheduler's: one field restricted, one open to `module:Class`"""
    fixed: str = _f("a", "one of a, b", choices=("a", "b"))
    open_policy: str = _f("fcfs", "a built-in name or module:Class")


def _plugin_parser():
    import argparse
    parser = argparse.ArgumentParser()
    add_config_flags(parser, _PluginConfig)
    return parser


def test_a_plain_str_field_accepts_any_value_and_a_field_with_choices_restricts():
    args = _plugin_parser().parse_args(["--open-policy", "mypkg.mod:MyPolicy"])
    assert args.open_policy == "mypkg.mod:MyPolicy" and args.fixed == "a"
    with pytest.raises(SystemExit):  # probe: declared choices really restrict
        _plugin_parser().parse_args(["--fixed", "c"])


@pytest.mark.parametrize("name", ["scheduling_policy", "preemption_policy", "dtype"])
def test_policy_flags_follow_what_the_field_declares(name):
    owner = SchedulerConfig if name != "dtype" else ModelConfig
    field = next(f for f in dataclasses.fields(owner) if f.name == name)
    action = next(a for a in _leaf(("simulate",))._actions if a.dest == name)
    declared = field.metadata.get("choices")
    assert action.choices == (list(declared) if declared is not None else None)


def test_one_tensor_parallel_flag_in_the_simulator_and_it_reaches_the_roofline(tmp_path):
    parse = build_parser().parse_args
    base = ["simulate", "--model-shape", "llama-7b", "--num-requests", "20",
            "--prompt-len", "fixed:512", "--output-len", "fixed:8"]
    assert parse([*base, "--tp", "2"]).tp == parse([*base, "--tensor-parallel-size", "2"]).tp == 2
    assert "tensor_parallel_size" not in engine_kwargs(parse([*base, "--tp", "2"]))

    def ttft(tp: str) -> float:
        out = tmp_path / f"tp{tp}.json"
        assert main([*base, "--tensor-parallel-size", tp, "--json", str(out)]) == 0
        return json.loads(out.read_text())["ttft_p50_ms"]
    assert ttft("2") < ttft("1")  # probe: the flag changed the simulated step times


def test_shapes_of_generated_flags(capsys):
    parse = build_parser().parse_args
    args = parse(["generate", "--prompt", "a", "--prompt", "b", "--no-chat", "--summary"])
    assert args.prompt == ["a", "b"] and args.no_chat and args.summary
    assert parse(["bench", "serve", "--base-url", "u", "--model", "m", "--goodput", "ttft:1",
                  "tpot:2"]).goodput == ["ttft:1", "tpot:2"]
    assert parse(["study", "frontier", "--chunks", "8,16"]).chunks == [8, 16]
    assert parse(["serve", "m", "--served-model-name", "x"]).model_tag == "m"
    with pytest.raises(SystemExit):
        parse(["study", "frontier", "--chunks", "8,x"])
    assert "expected comma-separated integers, got '8,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["sweep"])  # --set is required
    assert "--set" in capsys.readouterr().err


def test_the_default_model_is_written_once():
    assert ModelConfig().model is DEFAULT_MODEL and CalibrateConfig().model is DEFAULT_MODEL
    assert inspect.signature(tokenweir.LLM).parameters["model"].default is DEFAULT_MODEL
    # the literal appears as a default nowhere else; the loader's alias table and the
    # simulator's shape table name the model (they define what the name means)
    allowed = {"config.py", "model/paths.py", "sim/shape.py"}  # the alias table; shapes
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == DEFAULT_MODEL:
                found.add(str(path.relative_to(PACKAGE)))
    assert "config.py" in found and found <= allowed, found


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_the_simulator_refuses_batch_invariant(command, capsys):
    """--batch-invariant picks kernels; the simulator runs none, so its commands refuse the
    flag instead of ignoring it. Probe: the engine's commands do take it."""
    assert build_parser().parse_args(["generate", "--batch-invariant"]).batch_invariant is True
    argv = _minimal_argv(next(c for c in COMMANDS if c.path == (command,)))
    build_parser().parse_args(argv)  # parses without the flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--batch-invariant"])
    assert "--batch-invariant" in capsys.readouterr().err

"""The generated command line against recordings made before it existed (commit b2e2d84, the
hand-written parsers): the same subcommands, every flag spelling, dest, default, choices,
type, action and help text (help may only have grown), and the same parsed namespaces for
README's, the golden configurations' and the tests' command lines. Intended differences are
listed in CHANGES, one line each, so a new difference fails until it is written down here."""

from __future__ import annotations

import json

import pytest

from flag_table import RECORDING, flag_table  # tests/cli is on sys.path (pytest prepends it)
from recorded_commands import RECORDING as NAMESPACES, parsed
from tokenweir.cli import build_parser

RECORDED = json.loads(RECORDING.read_text())
NOW = flag_table(build_parser())

_TP_IN_SIM = {"dest": "tp", "default": "1", "help": "tensor-parallel degree (default: 1)"}
_PROFILE_HELP = ("step times from a fitted profile (tokenweir calibrate) instead of the roofline "
                 "of --model-shape/--hardware (every instance of a cluster) (default: None)")
# (command, spelling) -> {attribute: value now}: the differences made on purpose.
CHANGES: dict[tuple[str, str], dict[str, str]] = {
    # one tensor-parallel flag in the simulator: --tensor-parallel-size (vLLM's name), alias
    # --tp, both setting `tp`, the degree the roofline uses. Before, simulate and sweep also had
    # the engine's --tensor-parallel-size, which the simulator ignored.
    ("tokenweir simulate", "--tensor-parallel-size"): _TP_IN_SIM,
    ("tokenweir sweep", "--tensor-parallel-size"): _TP_IN_SIM,
    # the integer-list parser is config.int_list (was studies._ints; same values and message)
    ("tokenweir study frontier", "--chunks"): {"type": "int_list"},
    ("tokenweir study pool", "--blocks"): {"type": "int_list"},
    # the one simulator loop runs a fitted profile on every instance of a cluster too
    **{(f"tokenweir {c}", "--profile"): {"help": _PROFILE_HELP} for c in ("simulate", "sweep")},
    # issue 35: the slo policy's preemption cap 1 -> 3 (benchmarks/slo_goodput.py, mixed
    # workload: goodput 2.06x -> 2.99x fcfs)
    **{(f"tokenweir {c}", "--slo-max-preemptions"): {
        "help": "slo policy: a request paused or cut this many times becomes immune "
                "(default: 3)"} for c in ("generate", "serve", "simulate", "sweep")},
}
# any model from its config (issue 16): the shape and hardware tables grew; the simulator's
# --model picks a shipped config (the engine's --model, which it ignored, is left out)
_SIM_COMMANDS = ("simulate", "sweep", "study frontier", "study pool", "study policies")
_MODELS = sorted(__import__("tokenweir.sim.model_config", fromlist=["x"]).MODEL_TABLE)
_HARDWARE = sorted(__import__("tokenweir.sim.hardware", fromlist=["x"]).HARDWARE_PROFILES)
for _c in _SIM_COMMANDS:
    CHANGES[(f"tokenweir {_c}", "--model-shape")] = {"choices": _MODELS}
    CHANGES[(f"tokenweir {_c}", "--hardware")] = {"choices": _HARDWARE}
for _c in ("simulate", "sweep"):
    CHANGES[(f"tokenweir {_c}", "--model")] = {
        "dest": "model_name", "default": "None", "choices": _MODELS,
        "help": "a shipped model config by name (same names as --model-shape; replaces it) "
                "(default: None)"}
_SIM_NEW = {"--model-config", "--hardware-dtype"}
# spellings that did not exist: study gains the simulator's --tensor-parallel-size (alias --tp)
NEW_SPELLINGS = {f"tokenweir study {s}": {"--tensor-parallel-size", "--model"} | _SIM_NEW
                 for s in ("frontier", "pool", "policies")}
NEW_SPELLINGS["tokenweir simulate"] = NEW_SPELLINGS["tokenweir sweep"] = _SIM_NEW
# the server's request-body limit (a 413 above it), added with the edge validation, and the
# live schedule page's ring (GET /timeline)
NEW_SPELLINGS["tokenweir serve"] = {"--max-request-body-bytes", "--timeline-steps"}
NEW_DESTS = {"max_request_body_bytes", "timeline_steps", "model_name", "model_config",
             "hardware_dtype"}
# the serving profile (issue 12) and where outputs are processed (auto / on / off)
NEW_SPELLINGS["tokenweir serve"] |= {"--profile-serving", "--output-thread"}
NEW_DESTS |= {"profile_serving", "output_thread"}
# issue 16: the engine's step trace (generate, serve) and calibration from such traces
NEW_SPELLINGS["tokenweir serve"] |= {"--trace"}
NEW_SPELLINGS["tokenweir generate"] = {"--trace"}
NEW_SPELLINGS["tokenweir calibrate"] = {"--from-trace", "--holdout-every"}
NEW_DESTS |= {"step_trace", "from_trace", "holdout_every"}
# issue 16: how the slo policy predicts the step in flight (the engine's TTFT line, or the
# simulator's latency model); an engine flag, so every engine and simulator command has it
for _c in ("generate", "serve", "simulate", "sweep"):
    NEW_SPELLINGS[f"tokenweir {_c}"] = NEW_SPELLINGS.get(f"tokenweir {_c}", set()) | {
        "--slo-step-predictor"}
NEW_DESTS |= {"slo_step_predictor"}
# issue 12: weight-only int8 decode matmuls, an engine flag like --dtype
for _c in ("generate", "serve", "simulate", "sweep"):
    NEW_SPELLINGS[f"tokenweir {_c}"] |= {"--quantization"}
NEW_DESTS |= {"quantization"}
# issue 16: simulations over draws of the machine a trace-fitted profile measured
NEW_SPELLINGS["tokenweir simulate"] = NEW_SPELLINGS["tokenweir simulate"] | {"--samples"}
NEW_DESTS |= {"samples"}
# issue 35: the slo policy's TPOT target for requests that carry none (caps a step's chunk)
for _c in ("generate", "serve", "simulate", "sweep"):
    NEW_SPELLINGS[f"tokenweir {_c}"] |= {"--slo-tpot-ms"}
NEW_DESTS |= {"slo_tpot_ms"}
NEW_SPELLINGS["tokenweir serve"] |= {"--slo-reject-hopeless"}
NEW_DESTS |= {"slo_reject_hopeless"}
# issue 34: simulate writes step records for `tokenweir timeline`
NEW_SPELLINGS["tokenweir simulate"] = NEW_SPELLINGS["tokenweir simulate"] | {"--step-records"}
NEW_DESTS |= {"step_records"}
# issue 37: the serve command can start replicas behind the router; the simulator's routers
# are tokenweir/routing's, which adds session-affinity and accepts package.module:Class
NEW_SPELLINGS["tokenweir serve"] |= {"--data-parallel-size", "--routing-policy"}
NEW_DESTS |= {"data_parallel_size", "routing_policy"}
CHANGES[("tokenweir simulate", "--router")] = {
    "choices": None,
    "help": "how requests are spread over instances: round-robin, least-loaded, prefix-aware, "
            "session-affinity (a session's turns stay where its first went), or a policy class "
            "of your own as package.module:Class (tokenweir/routing/base.py) (default: "
            "round-robin)"}
# issue 37: sweep and studies run their points as Ray tasks with --ray [ADDRESS]
for _c in ("sweep", "study frontier", "study pool", "study policies"):
    NEW_SPELLINGS[f"tokenweir {_c}"] = NEW_SPELLINGS.get(f"tokenweir {_c}", set()) | {"--ray"}
NEW_DESTS |= {"ray"}
# issue 38: batch-invariant kernels, an engine flag like --quantization (not in simulate or
# sweep: the simulator runs no kernels; tokenweir/cli/commands.py, _SIM_EXCLUDE)
for _c in ("generate", "serve"):
    NEW_SPELLINGS[f"tokenweir {_c}"] |= {"--batch-invariant", "--no-batch-invariant"}
NEW_DESTS |= {"batch_invariant"}
# issue 35: a separate cap for the slo policy's pauses between steps (they waste no work)
for _c in ("generate", "serve", "simulate", "sweep"):
    NEW_SPELLINGS[f"tokenweir {_c}"] |= {"--slo-max-pauses"}
NEW_DESTS |= {"slo_max_pauses"}
# issue 34: the engine core in a process of its own beside the API process (serve)
NEW_SPELLINGS["tokenweir serve"] |= {"--engine-process", "--no-engine-process"}
NEW_DESTS |= {"engine_process"}
# these two will accept `module:Class` (another change): their choices and help may differ
POLICY_FLAGS = {"--scheduling-policy", "--preemption-policy"}
_CONVERTING = ("_StoreAction", "_AppendAction")  # actions whose missing type meant str


def _by_spelling(flags: dict[str, dict]) -> dict[str, dict]:
    return {spelling: spec for spec in flags.values() for spelling in spec["aliases"]}


# subcommands added since the recording
NEW_COMMANDS = {"tokenweir timeline", "tokenweir router"}


def test_the_same_subcommands():
    assert sorted(set(NOW) - NEW_COMMANDS) == sorted(RECORDED)
    assert NEW_COMMANDS <= set(NOW)


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_every_recorded_flag_survives_with_its_default_choices_and_help(command):
    now = _by_spelling(NOW[command])
    for spelling, before in _by_spelling(RECORDED[command]).items():
        assert spelling in now, f"{command}: {spelling} disappeared"
        after, changed = now[spelling], CHANGES.get((command, spelling), {})
        for attr in ("dest", "default", "choices", "nargs", "required", "type", "action",
                     "metavar"):
            expected = changed.get(attr, before[attr])
            if attr == "type" and expected is None and after["action"] in _CONVERTING:
                expected = "str"  # argparse's default conversion, now written out
            if attr == "choices" and spelling in POLICY_FLAGS and after[attr] is None:
                continue
            assert after[attr] == expected, (command, spelling, attr)
        _assert_help_kept(command, spelling, before["help"], after["help"], changed)


def _assert_help_kept(command, spelling, before: str, after: str, changed: dict) -> None:
    if "help" in changed:
        assert after == changed["help"]
    elif spelling not in POLICY_FLAGS:
        # a help that names its own default no longer also says "(default: None)"
        assert before.removesuffix(" (default: None)") in after, (command, spelling)


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_no_flag_appeared_unannounced(command):
    before = set(_by_spelling(RECORDED[command]))
    assert set(_by_spelling(NOW[command])) - before == NEW_SPELLINGS.get(command, set())


def test_the_recording_is_of_the_old_parser():
    """Probe: the recording really holds the wart CHANGES claims to remove."""
    simulate = _by_spelling(RECORDED["tokenweir simulate"])
    assert simulate["--tp"]["dest"] == "tp"
    assert simulate["--tensor-parallel-size"]["dest"] == "tensor_parallel_size"
    assert len(RECORDED["tokenweir simulate"]) == 63 and len(RECORDED["tokenweir serve"]) == 43


@pytest.mark.parametrize("item", json.loads(NAMESPACES.read_text()),
                         ids=lambda item: " ".join(item["argv"])[:60])
def test_recorded_command_lines_parse_to_the_same_namespace(item):
    now = {k: v for k, v in parsed(item["argv"]).items() if k not in NEW_DESTS}
    assert now == item["namespace"]

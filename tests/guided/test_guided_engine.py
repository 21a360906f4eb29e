"""Guided decoding on the default model, offline: every sample of a seeded run follows its
schema, choice, regex or grammar, ends with finish_reason "stop", and leaves the unguided
requests sharing its batch exactly as they were."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from tokenweir import SamplingParams
from tokenweir.request import GuidedDecodingParams as Guided

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PROMPT = "Write a JSON record describing a user of a web site:\n"
SEEDS = range(5)


def _run(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _guided(seed: int, max_tokens: int = 120, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          guided_decoding=Guided(**spec))


@pytest.fixture(scope="module")
def schema_batch(llm):
    """ONE batch (its steps are those of its longest request, ~52, not the ~130 of three
    batches run one after another): the schema as a dict under every seed, the same seeds
    unguided, and the schema as JSON text (seed 0). Returns those three groups of outputs and
    the masks the batch filled (unguided requests take none)."""
    masks_before = llm.llm_engine.guided.num_masks
    outs = _run(llm, [PROMPT] * (2 * len(SEEDS) + 1),
                [_guided(s, json=SCHEMA) for s in SEEDS]
                + [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in SEEDS]
                + [_guided(0, json=json.dumps(SCHEMA))])
    n = len(SEEDS)
    return {"guided": outs[:n], "free": outs[n:2 * n], "json_text": outs[2 * n],
            "masks": llm.llm_engine.guided.num_masks - masks_before}


def test_json_schema_output_validates_for_every_seed(schema_batch):
    validator = jsonschema_rs.validator_for(SCHEMA)
    outs = schema_batch["guided"]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert validator.is_valid(value), out.text
    assert len({o.text for o in outs}) > 1, "seeds at temperature 1 should differ"
    # Probe: every sampled token of the guided requests was masked (the mask is what made the
    # JSON valid), and no unguided token was ...
    guided = outs + [schema_batch["json_text"]]
    assert schema_batch["masks"] == sum(len(o.token_ids) for o in guided)
    # ... and without it the same seeds do not produce records that validate.
    assert not all(_validates(validator, o.text) for o in schema_batch["free"])


def _validates(validator, text: str) -> bool:
    try:
        return validator.is_valid(json.loads(text))
    except ValueError:
        return False


FEW_SHOT = ('Record: {"name": "Ann", "age": 31}\nRecord: {"name": "Bob", "age": 44}\n'
            'Record: ')


def test_json_object_output_is_an_object(llm):
    """Any JSON object: left alone at temperature 1 the small model writes endless numbers, so
    it is shown two records and decodes greedily (the grammar still decides where it ends)."""
    out = _run(llm, [FEW_SHOT], [SamplingParams(temperature=0, max_tokens=60,
                                                guided_decoding=Guided(json_object=True))])[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
    free = _run(llm, [FEW_SHOT], [SamplingParams(temperature=0, max_tokens=len(out.token_ids))])
    assert free[0].text != out.text  # probe: unguided, the model runs on past the object


def test_schema_given_as_json_text(schema_batch):
    out = schema_batch["json_text"]
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(out.text))


def test_choice_returns_one_of_the_choices(llm):
    choices = ["yes", "no", "it depends on the weather"]
    outs = _run(llm, ["Will it rain tomorrow? Answer:"] * 6,
                [_guided(s, choice=choices) for s in range(6)])
    for out in outs:
        assert out.text in choices and out.finish_reason == "stop"


def test_min_tokens_holds_back_an_eos_the_grammar_leaves_as_the_only_token(llm):
    """min_tokens is enforced twice, as in vLLM: the sampler masks EOS and the stop ids below it
    (tests/engine/test_llm.py::test_stop_rules), and the stop rule (core/sched/stop.py) does
    not finish a request on a stop token below it. Here, once "yes" is out, the grammar allows
    EOS alone: the sampler's mask would leave nothing finite and is dropped (model/sampler.py),
    so EOS is sampled below min_tokens and only the stop rule keeps the request going."""
    params = [SamplingParams(temperature=0, max_tokens=8, min_tokens=m,
                             guided_decoding=Guided(choice=["yes"])) for m in (0, 3)]
    plain, held = _run(llm, ["Will it rain tomorrow? Answer:"] * 2, params)
    eos = llm.get_tokenizer().eos_token_ids
    assert plain.text == held.text == "yes" and held.finish_reason == "stop"
    assert len(plain.token_ids) == 2 and plain.token_ids[-1] in eos  # probe: EOS right after
    assert len(held.token_ids) == 3 and set(held.token_ids[1:]) <= eos


def test_regex_output_matches(llm):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    outs = _run(llm, ["Call me at"] * 4, [_guided(s, regex=pattern) for s in range(4)])
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


@pytest.mark.parametrize("grammar, pattern", [
    ('root ::= "The answer is " digit digit "."\ndigit ::= [0-9]', r"The answer is \d\d\."),
    ('start: pair pair? pair? "!"\npair: "ab" | "cd"', r"(ab|cd){1,3}!"),
])
def test_grammar_output_matches(llm, grammar, pattern):
    outs = _run(llm, ["Say something:"] * 3,
                [_guided(s, max_tokens=40, grammar=grammar) for s in range(3)])
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


def test_greedy_guided_picks_the_models_favourite_allowed_token(llm):
    free = _run(llm, ["The capital of France is"],
                [SamplingParams(temperature=0, max_tokens=3)])[0]
    first = free.text.split()[0]
    out = _run(llm, ["The capital of France is"],
               [SamplingParams(temperature=0, max_tokens=8,
                               guided_decoding=Guided(choice=[" Berlin", f" {first}"]))])[0]
    assert out.text == f" {first}"


def test_a_guided_request_leaves_its_unguided_neighbours_unchanged(llm):
    prompts = ["The river", "Once upon a time", "def fibonacci(n):", "Dear diary,"]
    # 16 tokens each: all of them beside the guided one (~31 tokens), masked in every step
    plain = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True)
             for i in range(len(prompts))]
    alone = _run(llm, prompts, plain)
    masks_before = llm.llm_engine.guided.num_masks
    mixed = _run(llm, prompts[:2] + [PROMPT] + prompts[2:],
                 plain[:2] + [_guided(7, json=SCHEMA)] + plain[2:])
    guided = mixed.pop(2)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    # Probe: the guided request really ran in that batch, masked, and follows its schema.
    assert llm.llm_engine.guided.num_masks - masks_before == len(guided.token_ids)
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(guided.text))


def test_guided_request_survives_preemption(make_llm):
    """A cramped pool preempts (recompute): the guided request's matcher is rebuilt from its
    output so far and its JSON still validates."""
    llm = make_llm(num_gpu_blocks_override=9, block_size=16, max_num_batched_tokens=64,
                   max_model_len=128,
                   scheduler_reserve_full_isl=False, enable_prefix_caching=False)
    prompts = [PROMPT + f"Record number {i}:\n" for i in range(4)]
    outs = llm.generate(prompts, [_guided(s, max_tokens=100, json=SCHEMA) for s in range(4)],
                        use_tqdm=False)
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    assert preemptions > 0, "the pool was meant to be too small for all four"
    for o in outs:
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(o.outputs[0].text))


@pytest.mark.parametrize("guided, field", [
    (Guided(json={"type": "nope"}), "guided_decoding.json"),
    (Guided(regex="(unclosed"), "guided_decoding.regex"),
    (Guided(grammar="start: ("), "guided_decoding.grammar"),
])
def test_a_bad_spec_is_refused_when_the_request_is_made(llm, guided, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["Hi"], SamplingParams(guided_decoding=guided), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_masks_are_filled_on_the_worker_thread(llm):
    guided = llm.llm_engine.guided
    fill_before = guided.fill_seconds
    out = _run(llm, ["Call me at"], [_guided(3, regex=r"\d{3}-\d{4}")])[0]
    assert re.fullmatch(r"\d{3}-\d{4}", out.text)
    assert guided.fill_thread is not None and guided.fill_thread.startswith("tokenweir-guided")
    assert guided.fill_seconds > fill_before

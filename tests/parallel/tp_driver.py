"""Drive any executor (`execute(SchedulerOutput)`) with the real scheduler on a fixed
workload; a cut step is rolled back exactly as the engine does (`roll_back_cut_step`)."""

from __future__ import annotations

import threading

import torch

from harness import make_prompt_request, make_scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 200
PROMPT_LENS = (30, 7, 12, 1)  # a chunked prefill, short prompts, a 1-token prompt
# The group timeout, and the bound on any single blocking test action. It also bounds the
# rendezvous (workers start a Python, import torch, load the model, join the TCPStore):
# 20 s ran out on a shared 2-core machine under load. A passing test never waits for it.
TIMEOUT_S = 60.0
START_BOUND_S = 2 * TIMEOUT_S  # an executor's start: past the group's own timeout error


def bounded(fn, timeout_s: float = TIMEOUT_S):
    """Run fn() in a thread; fail (instead of hanging) if it does not return in time."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"hung for more than {timeout_s} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_workload(executor, max_tokens: int = 6, logprobs: int | None = 3):
    """Returns (output tokens per request, sampled logprob records, cuts, the scheduler).
    Each cut is (CutReport, the layers the workers reported: [] for a single-process runner)."""
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256,
                               max_num_batched_tokens=24, long_prefill_token_threshold=16)
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(3, 384, (n,), generator=gen).tolist()
        scheduler.add_request(make_prompt_request(f"r{i}", prompt, max_tokens=max_tokens,
                                                  logprobs=logprobs))
    tokens, records, cuts = {}, [], []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        result = executor.execute(out)
        if result.cut is not None:  # as EngineCore does: the step never happened
            layers = [s.get("layer") for s in getattr(executor, "last_statuses", [])]
            cuts.append((result.cut, layers))
            scheduler.roll_back_cut_step(out, result.cut.victim_id or None,
                                         result.cut.layer_index, result.cut.num_layers)
            continue
        records += [(out.step_id, rid, lp) for rid, lp in result.logprobs.items()]
        for eco in scheduler.update_from_output(out, result):
            if eco.finish_reason is not None:
                tokens[eco.request.request_id] = eco.request.output_token_ids
        scheduler.check_integrity()
    return tokens, records, cuts, scheduler

"""Stop rules: one function for every path that appends a token (the decode fast path in
update_from_output only skips tokens that provably cannot stop a request)."""

from __future__ import annotations

from typing import Optional

from tokenweir.request import Request, RequestStatus


def stop_status(request: Request, token_id: int, max_model_len: int) -> Optional[RequestStatus]:
    """vLLM's stop rules for `token_id`, just appended: EOS, then stop_token_ids, both held off
    until min_tokens; then length. The length cap is hard: `request.max_tokens` (capped to
    max_model_len) may be below min_tokens. Sets `request.stop_reason` for a stop token id."""
    params = request.sampling_params
    num_output_tokens = request.num_output_tokens
    if num_output_tokens >= params.min_tokens:
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def fast_length_cap(request: Request) -> int:
    """The length the decode fast path stays below: prompt + max_tokens (the length cap, kept
    within max_model_len by add_request), or 0 before the request's first token (its first
    token is never on the fast path) and for a request with stop_token_ids, whose every token
    takes the full rule."""
    if request.first_token_time is None or request.sampling_params.stop_token_ids:
        return 0
    return request.max_num_tokens

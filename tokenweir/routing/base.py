"""The routing-policy interface: which replica (or simulated instance) serves the next request.

One interface for the simulator's cluster (tokenweir/sim/cluster.py) and the real router
(tokenweir/router/): a policy studied in the simulator is the policy that routes real traffic.
Write your own in your own file and name it `package.module:Class`
(`--router mypkg.mod:MyPolicy` in `tokenweir simulate`, `--routing-policy mypkg.mod:MyPolicy`
in `tokenweir router`), exactly as scheduling policies plug in.

Contracts:
- Built as `Class(num_instances, block_size)`; `block_size` is the unit a prefix-aware policy
  hashes prompts in (the KV block size in the simulator; bytes of prompt text in the router).
- `choose(tokens, loads, session=None)` returns an index in `range(num_instances)`.
  `tokens` is the prompt as ints (token ids in the simulator; the prompt text's UTF-8 bytes in
  the router, which holds no tokenizer); `loads[i]` is instance i's load, a number where lower
  means less loaded (the simulator: requests there or on their way; the router: see
  tokenweir/router/replicas.py); `session` is a conversation key when the caller has one.
- A load of `UNAVAILABLE` (infinity) marks an instance that must not be chosen while any other
  has a finite load (the router's replicas that are down). Never all of them: the caller
  answers 503 itself when no instance is available.
- Pure and deterministic: a choice depends only on the arguments and on what the policy itself
  chose before. No clocks, no I/O: `choose` runs once per routed request on the caller's loop.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Hashable, Optional, Sequence

UNAVAILABLE = math.inf  # the load of an instance that must not be chosen


class RoutingPolicy(ABC):
    def __init__(self, num_instances: int, block_size: int = 16) -> None:
        if num_instances < 1:
            raise ValueError(f"a routing policy needs >= 1 instance, got {num_instances}")
        self.num_instances, self.block_size = num_instances, block_size

    @abstractmethod
    def choose(self, tokens: list[int], loads: Sequence[float],
               session: Optional[Hashable] = None) -> int:
        """The index of the instance that serves a request with prompt `tokens`."""


def least_loaded(loads: Sequence[float]) -> int:
    """The instance with the least load; ties go to the lowest index."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))

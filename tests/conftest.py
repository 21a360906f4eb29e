"""Suite-wide settings: engines skip the start-up warm-up (one dummy step of the whole token
budget, ~1-3 s on SmolLM2-135M), since the suite builds hundreds of engines; the warm-up's own
tests turn it back on (tests/engine/test_warm_up.py). Child processes inherit it."""

import os

os.environ.setdefault("TOKENWEIR_WARMUP", "0")

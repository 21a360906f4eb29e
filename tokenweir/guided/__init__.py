"""Guided decoding (structured output) through llguidance: JSON schemas, JSON objects,
regular expressions, choices and context-free grammars.

- grammar.py: GuidedDecodingParams -> a checked llguidance grammar (ValueError naming the field);
- vocab.py:   the model's vocabulary as bytes, which llguidance's tokenizer is built from;
- decoder.py: the runner's per-request matchers and the token masks of a step, computed on a
              worker thread while the step's forward runs;
- masks.py:   token bitmasks applied to the logits (torch only; the sampler's one call).

Nothing is imported here, so the sampler's import of masks.py does not load llguidance.
"""

"""How the grammar library was chosen: xgrammar 0.2.8 vs llguidance 1.9.1 on SmolLM2's
vocabulary (49,152 tokens), one library per run:

    python benchmarks/guided_library_choice.py llguidance
    pip install --no-deps --target /tmp/gx xgrammar==0.2.8 apache-tvm-ffi triton
    PYTHONPATH=/tmp/gx python benchmarks/guided_library_choice.py xgrammar

Prints: building the library's tokenizer from our vocabulary (tokenweir/guided/vocab.py), the
compile time of one JSON schema (three times, each with a fresh title so no cache answers),
the per-token mask time while a valid document is walked token by token (every token of it
must be allowed), how much a pure-Python loop slows down beside a thread filling masks (does
the library drop the GIL), and the library's own bitmask-apply on [8, vocab] logits.
"""
import json, sys, threading, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from gguf import GGUFReader
from tokenweir.model.loader import resolve_model_path, read_gguf_metadata
from tokenweir.model.tokenizer import Tokenizer
from tokenweir.guided.vocab import vocabulary_of
lib = sys.argv[1]
p = resolve_model_path("smollm2-135m"); meta = read_gguf_metadata(GGUFReader(p))
tok = Tokenizer.from_gguf_metadata(meta, p)
V = 49152
voc = vocabulary_of(tok, V)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
  "required": ["name", "age", "email", "role", "tags", "address"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "role": "admin",
       "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "12345"}})
ids = tok.encode(DOC, add_special_tokens=False) + [2]
print(lib, "doc tokens", len(ids))
mask = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
t0 = time.perf_counter()
if lib == "xgrammar":
    import xgrammar as xgr
    info = xgr.TokenizerInfo(voc.token_bytes, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=sorted(voc.stop_ids))
    t1 = time.perf_counter()
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    def compile_(s): return comp.compile_json_schema(json.dumps(s), any_whitespace=True)
    def matcher(g): return xgr.GrammarMatcher(g)
    def fill(m): m.fill_next_token_bitmask(mask, 0)
    def accept(m, t): assert m.accept_token(t), t
    def done(m): return m.is_terminated()
else:
    import llguidance as llg
    from tokenweir.guided.decoder import llguidance_tokenizer
    info = llguidance_tokenizer(voc)
    t1 = time.perf_counter()
    def compile_(s): return llg.LLMatcher(info, llg.LLMatcher.grammar_from_json_schema(s))
    def matcher(g): return g  # compile == matcher construction
    from llguidance.torch import fill_next_token_bitmask
    def fill(m): fill_next_token_bitmask(m, mask, 0)
    def accept(m, t): assert m.consume_token(t), (t, m.get_error())
    def done(m): return m.is_stopped()
print(f"tokenizer info: {t1-t0:.3f} s")
times = []
for r in range(3):
    s = dict(SCHEMA); s["title"] = f"run{r}"  # defeat caches
    t = time.perf_counter(); g = compile_(s); times.append(time.perf_counter() - t)
print("schema compile s:", ["%.4f" % x for x in times])
g = compile_(SCHEMA)
per = []
for rep in range(3):
    m = matcher(g) if lib == "xgrammar" else compile_(SCHEMA)
    for t in ids:
        a = time.perf_counter(); fill(m); per.append(time.perf_counter() - a)
        # the doc's token must be allowed by the mask
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, ("disallowed", t, tok.decode([t]))
        accept(m, t)
    assert done(m), "not terminated"
per.sort()
print(f"mask per token: median {statistics.median(per)*1e6:.0f} us, p90 {per[int(.9*len(per))]*1e6:.0f} us, max {per[-1]*1e6:.0f} us, n={len(per)}")
# GIL: time a pure-Python loop alone, then while another thread computes masks
def pyloop():
    x = 0
    for i in range(3_000_000): x += i
t = time.perf_counter(); pyloop(); alone = time.perf_counter() - t
stop = False; n_masks = 0
m = matcher(g) if lib == "xgrammar" else compile_(SCHEMA)
def masker():
    global n_masks
    while not stop:
        fill(m); n_masks += 1
th = threading.Thread(target=masker); th.start()
t = time.perf_counter(); pyloop(); together = time.perf_counter() - t
stop = True; th.join()
print(f"python loop alone {alone:.3f} s, with a mask thread {together:.3f} s ({n_masks} masks meanwhile)")
# apply mask to a [8, V] logits tensor
logits = torch.randn(8, V)
bm = mask.expand(8, -1).contiguous()
if lib == "xgrammar":
    ap = lambda: xgr.apply_token_bitmask_inplace(logits, bm)
else:
    from llguidance.torch import apply_token_bitmask_inplace as ap0
    ap = lambda: ap0(logits, bm)
ap(); t = time.perf_counter()
for _ in range(20): ap()
print(f"apply bitmask [8, {V}]: {(time.perf_counter()-t)/20*1e6:.0f} us")

"""Timeline page of a run: which request ran what in each step (issue 17).

- records.py: the step-record JSONL format (read it first), Trace, StepRing (live server)
- recorder.py: step records from the scheduler (StepRecorder, record_simulation)
- tracer.py: step records from the real engine (StepTracer, EngineCore's step observer;
  JsonlSink behind `--trace FILE`, StepRing behind a live server's /timeline)
- chrome.py: the simulator's chrome trace -> step records (derived, marked estimated), and
  step records -> a chrome trace (one process per run: runs side by side in Perfetto)
- layout.py: records -> what the page draws (run-length rows, series, drop notes)
- page.py: render_html / render_traces / build_page; static/: the page's HTML, CSS, JS
- cli.py: what `tokenweir timeline TRACE [TRACE2] [-o page.html]` runs (tokenweir/cli)
"""

from tokenweir.timeline.cli import run
from tokenweir.timeline.page import build_page, load_trace, render_html, render_traces
from tokenweir.timeline.records import StepRing, Trace, load_jsonl, write_jsonl

__all__ = ["run", "build_page", "load_trace", "render_html",
           "render_traces", "StepRing", "Trace", "load_jsonl", "write_jsonl"]

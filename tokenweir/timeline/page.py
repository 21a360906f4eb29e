"""The self-contained timeline page: one HTML file with the data, its CSS and its JavaScript
inline (nothing fetched from the network)."""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Iterable, Optional, Union

from tokenweir.timeline.chrome import is_chrome_trace, load_chrome_trace
from tokenweir.timeline.layout import MAX_COLUMNS, MAX_ROWS, page_model
from tokenweir.timeline.records import Trace, load_jsonl


def _static(name: str) -> str:
    return resources.files("tokenweir.timeline").joinpath("static", name).read_text("utf-8")


def _script_json(obj) -> str:
    """JSON safe inside a <script> element ("</script>" cannot end it early)."""
    return json.dumps(obj, separators=(",", ":")).replace("</", "<\\/")


def render_traces(traces: list[Trace], title: Optional[str] = None,
                  refresh_seconds: Optional[float] = None, max_rows: int = MAX_ROWS,
                  max_columns: int = MAX_COLUMNS) -> str:
    """The page for one trace, or several side by side (rows aligned by request id)."""
    title = title or "tokenweir timeline: " + " vs ".join(t.label for t in traces)
    options = {"refreshSeconds": refresh_seconds} if refresh_seconds else {}
    parts = {"__TITLE__": html.escape(title), "__CSS__": _static("timeline.css"),
             "__DATA__": _script_json(page_model(traces, max_rows, max_columns)),
             "__OPTIONS__": "window.TIMELINE_OPTIONS = " + _script_json(options) + ";",
             "__JS__": _static("timeline.js").replace("</script", "<\\/script")}
    page = _static("timeline.html")
    for key in ("__TITLE__", "__CSS__", "__OPTIONS__", "__JS__"):
        page = page.replace(key, parts[key])
    return page.replace("__DATA__", parts["__DATA__"])  # last: data may hold any text


def render_html(step_records: Iterable[dict],
                request_records: Union[None, dict[str, dict], Iterable[dict]] = None,
                label: str = "live", title: Optional[str] = None,
                refresh_seconds: Optional[float] = None, **limits) -> str:
    """The page for one in-memory run: step records (records.py), optionally the request
    records (a list, or a dict by id). What a live server's `/timeline` returns, with
    `refresh_seconds` set so the page reloads itself (keeping its scroll position)."""
    if request_records is None:
        requests = {}
    elif isinstance(request_records, dict):
        requests = request_records
    else:
        requests = {str(r["id"]): r for r in request_records}
    trace = Trace(sorted(step_records, key=lambda s: s["step"]), requests, {"label": label})
    return render_traces([trace], title, refresh_seconds, **limits)


def load_trace(path: str | Path) -> Trace:
    """A step-record JSONL file, or a simulator chrome trace (converted)."""
    return load_chrome_trace(path) if is_chrome_trace(path) else load_jsonl(path)


def build_page(traces: list[str | Path | Trace], out_path: str | Path, **kw) -> Path:
    """Write the page for these traces (paths or Trace objects) to out_path."""
    loaded = [t if isinstance(t, Trace) else load_trace(t) for t in traces]
    for path, trace in zip(traces, loaded):
        if not isinstance(path, Trace) and not trace.meta.get("label"):
            trace.meta["label"] = Path(path).name
    out = Path(out_path)
    out.write_text(render_traces(loaded, **kw), encoding="utf-8")
    return out

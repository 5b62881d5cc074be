"""What every page shares: a database session per call, the caller from the per-session user
state, number fields whose range the handler checks, HTML helpers (escaping, images, progress
bars, SVG line plots), the CSS and the page script (keyboard shortcuts, the double-click guard,
tooltips).

The user state (`gr.State`) holds only the API token; every handler re-authenticates with it
(`auth.authenticate`, cached for a few seconds), so a revoked token or a role change takes
effect and a hidden page's handler refuses a caller without the role.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import quote

import gradio as gr
from gradio.utils import get_upload_folder
from sqlalchemy.orm import Session

from app import db
from app.errors import BadRequest, ServiceError, Unauthorized
from app.models import User
from app.services import auth, datasets, storage

log = logging.getLogger(__name__)

# images at most this big are inlined as data URIs (no request, nothing to leak in a URL);
# bigger ones load from /api/media with the session cookie set at login (app/api/media.py)
INLINE_MAX_BYTES = 256 * 1024
IMAGE_TYPES = {".png": "image/png", ".webp": "image/webp", ".jpg": "image/jpeg",
               ".jpeg": "image/jpeg"}


@contextmanager
def session() -> Iterator[Session]:
    """A short session that commits on success (services flush; the boundary commits)."""
    with db.session_scope() as s:
        yield s


# what `caller` says to a page no one is logged into (a login that ended says why it ended)
LOG_IN_FIRST = "log in first"


def caller(user_state: dict | None, *roles: str) -> User:
    """The logged-in user of this browser session; Unauthorized/Forbidden as in the API."""
    token = (user_state or {}).get("token")
    if not token:
        raise Unauthorized(LOG_IN_FIRST)
    with db.new_session() as s:
        user = auth.authenticate(s, token)
    if roles:
        auth.require_role(user, *roles)
    return user


def admin_or_none(user_state: dict | None) -> User | None:
    """For handlers that fire for everyone (a login, a logout, a dropdown's focus): the caller
    if the server says they are an admin, None if no one is logged in or they are not (the
    page shows nothing then). The role in `user_state` is never trusted: a revoked or unknown
    token raises Unauthorized, as `caller` does, so an open session of a revoked admin gets an
    error rather than the data."""
    if not (user_state or {}).get("token"):
        return None
    user = caller(user_state)
    return user if user.role == "admin" else None


def login_ended(exc: Exception) -> bool:
    """Whether `exc` says the page's login ended under it: its token revoked or replaced, its
    session expired or logged out elsewhere (not a page no one logged into)."""
    return isinstance(exc, Unauthorized) and exc.message != LOG_IN_FIRST


def admin_or_toast(user_state: dict | None) -> User | None:
    """`admin_or_none` for a picker's refresh, whose outputs have no place for a message:
    None (the picker is left alone) for a login that ended, which the login area says once
    (app.ui.login's check when a tab is shown): a toast each picker raised put two or three
    red "Error" toasts on every tab the user opened. Any other failure is Gradio's toast."""
    try:
        return admin_or_none(user_state)
    except Exception as exc:  # noqa: BLE001 - shown to the user
        if login_ended(exc):
            return None
        raise gr.Error(error_text(exc)) from None


def error_text(exc: Exception) -> str:
    """What the page shows for an exception. A `ServiceError` (the services' typed errors, and
    `BadRequest` for a user's mistake caught in a handler) is the user's to fix: its message
    as it is. Anything else is a bug or the server's trouble: its text can name server paths
    (an OSError's does), so it goes to the log and the page gets only its kind."""
    if login_ended(exc):
        # a login that ended under the page (revoked, expired): what to do about it
        return (f"{exc.message}: reload the page and log in again (with a new token from an "
                "admin if yours was revoked)")
    if isinstance(exc, ServiceError):
        return exc.message
    log.error("unexpected error in a UI handler", exc_info=exc)
    return (f"Something went wrong on the server ({type(exc).__name__}); "
            "the server log has the details.")


def whole_number(value: Any, label: str, minimum: int, maximum: int | None = None) -> int:
    """A form's number as an int, or BadRequest naming the field and what it allows. Number
    fields are built without `precision` so that 1.5 reaches this check instead of being
    rounded to 2 on the way in."""
    allowed = (f"{label}: a whole number from {minimum} to {maximum}" if maximum is not None
               else f"{label}: a whole number from {minimum} up")
    x = _form_float(value, allowed)
    if not math.isfinite(x) or x != int(x) or x < minimum or (maximum is not None
                                                             and x > maximum):
        raise BadRequest(f"{allowed}, got {as_typed(value, x)}")
    return int(x)


def number_below(value: Any, label: str, minimum: float, below: float) -> float:
    """A form's number as a float from `minimum` up to but not including `below` (the API's
    `ge`/`lt`), or BadRequest naming the field and what it allows, as `whole_number` does:
    an empty box too, never a default put in its place. -0 is 0, as the API stores it."""
    allowed = f"{label}: a number from {minimum:g} to under {below:g}"
    x = _form_float(value, allowed)
    if not math.isfinite(x) or not minimum <= x < below:
        raise BadRequest(f"{allowed}, got {as_typed(value, x)}")
    return x + 0.0


# a float holds every whole number below this exactly; the browser sends a number field's
# value as a JavaScript number, so a longer one (99999999999999999) came already rounded
EXACT_WHOLE = 2**53
# an echoed value longer than this is cut (a text box can hold a page of digits)
ECHO_CHARS = 40


def as_typed(value: Any, x: float) -> str:
    """A refused number (`value` as the form sent it, `x` as a float) the way the user typed
    it, for "got ..." in a field's error: `{x:g}` wrote 99999999 as "1e+08" and
    99999999999999999999999 as "1e+23". A text box's value is its text; a number field's is
    written out in digits, whole ones without ".0", and one the browser may have rounded on
    the way (beyond `EXACT_WHOLE`) says "about"."""
    if isinstance(value, str):
        text = value.strip()
        return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"
    if not math.isfinite(x):
        return str(x)  # inf, nan: a number field's script can send them, nobody types them
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(value)
    else:
        # the float's shortest round-trip digits (those the browser sent), without the
        # exponent repr gives 0.0000001 ("1e-07") and 1e23, nor the ".0" of a whole one
        digits = format(Decimal(repr(x)), "f")
        if x == int(x):
            digits = digits.removesuffix(".0")
    if len(digits) > ECHO_CHARS:
        digits = repr(x)  # 1e+300: three hundred digits would say no more
    return f"about {digits}" if abs(x) >= EXACT_WHOLE else digits


def _form_float(value: Any, allowed: str) -> float:
    """A form field's value as a float, or BadRequest `allowed` (what the field takes): an
    empty box, and text that is no number (said with what was given)."""
    if value is None or not str(value).strip():
        raise BadRequest(allowed)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{allowed}, got {str(value)[:ECHO_CHARS]!r}") from None


def _range_left_to_the_handler(num: float, minimum: float | None,
                               maximum: float | None) -> None:
    """Stands in for gr.Number's own range check (see `number`): the handler checks."""


def number(value: float | None = None, *, minimum: float | None = None,
           maximum: float | None = None, step: float | str = 1, **kw: Any) -> gr.Number:
    """A number field whose `minimum` and `maximum` guide the browser only: they become the
    input's min and max, where its arrow keys stop. Gradio would also check them before the
    handler runs, and its error is a toast that names no field ("Value 0 is less than minimum
    value 1."), leaving the page's old results on screen and a traceback in the server log;
    the handler checks the range instead and its message names the field (`whole_number`, the
    launch form's field errors). No `precision`, for the reason `whole_number` gives.

    Gradio builds a session's own copy of a field that gets an update (`gr.Number(...)`,
    `gr.skip()`), with its own check back; the UI's root Blocks hands the copy this field's
    stand-in again (`app.ui.keep_instance_overrides`)."""
    # `step` goes to the input as it is: "any" (HTML's word for no step) works though Gradio's
    # signature says float
    field = gr.Number(value, minimum=minimum, maximum=maximum, step=step, **kw)
    # gr.Number.preprocess calls self.raise_if_out_of_bounds: the instance's attribute wins.
    # A subclass would say it plainly, but forms and tests take the field for a gr.Number
    field.raise_if_out_of_bounds = _range_left_to_the_handler
    return field


def uploaded_file(value: str | None) -> Path:
    """The file behind a `gr.File(type="filepath")` value, if Gradio's upload folder holds it
    (symlinks resolved). The value comes from the client, which can name any path; anything
    else is refused with a message that does not echo the path, and so is a missing file (an
    outside path gets the same answer whether or not it exists)."""
    if not value:
        raise BadRequest("choose a file first")
    root = Path(get_upload_folder()).resolve()
    path = Path(value).resolve()
    if not path.is_relative_to(root):
        raise BadRequest("that file was not uploaded through this page: choose it again")
    if not path.is_file():
        raise BadRequest("the uploaded file is no longer on the server: choose it again")
    return path


def dataset_options(limit: int = 1000) -> list[tuple[str, int]]:
    """Every dataset as a picker's (label, id) choice, labelled the same on every page."""
    with session() as s:
        rows, _ = datasets.list_datasets(s, limit=limit)
        return [(f"#{d.id} {d.name} ({d.num_prompts} prompts)", d.id) for d in rows]


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def image_src(rel_path: str) -> str:
    """A data URI for a small image, else its /api/media URL (the login's cookie opens it)."""
    try:
        path = storage.resolve(rel_path)
    except ServiceError:
        return ""
    try:
        size = path.stat().st_size
    except OSError:
        return ""
    if size <= INLINE_MAX_BYTES:
        mime = IMAGE_TYPES.get(path.suffix.lower(), "image/jpeg")
        return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
    return media_link(path.relative_to(storage.storage_root()).as_posix())


def media_link(rel_path: str) -> str:
    """The /api/media URL of a stored file (the login's cookie opens it)."""
    return "/api/media/" + quote(rel_path)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def progress_bar(fraction: float | None, label: str = "", elem_class: str = "") -> str:
    pct = 0.0 if fraction is None else max(0.0, min(1.0, fraction)) * 100
    return (f'<div class="ngs-progress {elem_class}" role="progressbar" aria-valuemin="0" '
            f'aria-valuemax="100" aria-valuenow="{pct:.1f}"><div class="ngs-progress-fill" '
            f'style="width:{pct:.1f}%"></div><span>{esc(label)}</span></div>')


# the plots' 10px sans-serif tick labels: about this many pixels per character (digits and
# "-" in the usual sans fonts), so the left margin fits the longest label, minus sign included
TICK_CHAR_PX = 6.5
LEGEND_ROW_PX = 13


def line_plot(title: str, xs: Sequence[float], series: dict[str, Sequence[float | None]],
              band: tuple[Sequence[float | None], Sequence[float | None]] | None = None,
              width: int = 320, height: int = 160, elem_id: str = "") -> str:
    """A small inline SVG line plot (no JS, no network): one polyline per series and an
    optional shaded band (e.g. mean ± std). `data-points` says how many x values it has.
    A legend under the title names every series, a single one too (what the line is: the
    title may name the plot, not the reward)."""
    values = [v for s in series.values() for v in s if v is not None]
    if band:
        values += [v for s in band for v in s if v is not None]
    colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"]
    # the legend: entries left to right under the title, wrapping to more rows as needed
    legend, lx, rows = [], 8.0, 1
    for k, name in enumerate(series):
        w = 14 + TICK_CHAR_PX * len(name) + 10
        if lx > 8 and lx + w > width - 8:
            lx, rows = 8.0, rows + 1
        y = 13 + LEGEND_ROW_PX * rows
        color = colors[k % len(colors)]
        legend.append(f'<g class="ngs-legend" data-series="{esc(name)}">'
                      f'<line x1="{lx:.0f}" y1="{y - 3}" x2="{lx + 10:.0f}" y2="{y - 3}" '
                      f'stroke="{color}" stroke-width="2"/><text x="{lx + 14:.0f}" y="{y}" '
                      f'class="ngs-tick">{esc(name)}</text></g>')
        lx += w
    pad_t = 20 + (LEGEND_ROW_PX * rows if series else 0)
    pad_r, pad_b = 8, 20
    y0, y1 = (min(values), max(values)) if values else (0.0, 1.0)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    lo_label, hi_label = (f"{y0:.3g}", f"{y1:.3g}") if xs and values else ("", "")
    pad_l = max(30, round(8 + TICK_CHAR_PX * max(len(lo_label), len(hi_label))))
    height = max(height, pad_t + pad_b + 60)
    head = (f'<svg class="ngs-plot" id="{esc(elem_id)}" data-points="{len(xs)}" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg"><text x="8" y="13" class="ngs-plot-title">'
            f'{esc(title)}</text>' + "".join(legend))
    if not xs or not values:
        return head + (f'<text x="{width / 2}" y="{(pad_t + height) / 2}" text-anchor="middle" '
                       f'class="ngs-plot-empty">no data yet</text></svg>')
    x0, x1 = min(xs), max(xs)
    one_x = x1 == x0
    if one_x:  # one iteration so far: it stands in the middle, its label under it
        x0, x1 = x0 - 1, x0 + 1

    def px(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def py(y: float) -> float:
        return pad_t + (y1 - y) / (y1 - y0) * (height - pad_t - pad_b)

    parts = [head,
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" '
             f'y2="{height - pad_b}" class="ngs-axis"/>',
             f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" '
             f'class="ngs-axis"/>',
             f'<text x="{pad_l - 4}" y="{pad_t + 4}" text-anchor="end" class="ngs-tick">'
             f'{hi_label}</text>',
             f'<text x="{pad_l - 4}" y="{height - pad_b}" text-anchor="end" class="ngs-tick">'
             f'{lo_label}</text>',
             *([f'<text x="{px(x0 + 1):.1f}" y="{height - 5}" text-anchor="middle" '
                f'class="ngs-tick">{x0 + 1:g}</text>'] if one_x else
               [f'<text x="{pad_l}" y="{height - 5}" class="ngs-tick">{x0:g}</text>',
                f'<text x="{width - pad_r}" y="{height - 5}" text-anchor="end" '
                f'class="ngs-tick">{x1:g}</text>'])]
    if band:
        lo, hi = band
        top = [(px(x), py(h)) for x, h in zip(xs, hi, strict=False) if h is not None]
        bot = [(px(x), py(v)) for x, v in zip(xs, lo, strict=False) if v is not None]
        if top and bot:
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in top + bot[::-1])
            parts.append(f'<polygon points="{pts}" class="ngs-band"/>')
    for k, (name, ys) in enumerate(series.items()):
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=False)
                       if y is not None)
        color = colors[k % len(colors)]
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" '
                     f'stroke-width="1.5" class="ngs-line" data-series="{esc(name)}"/>')
        if len(pts.split()) == 1:  # a line through one point draws nothing: a dot does
            cx, cy = pts.split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{color}" class="ngs-point" '
                         f'data-series="{esc(name)}"/>')
    parts.append("</svg>")
    return "".join(parts)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], elem_class: str = "") -> str:
    """An HTML table; cells are escaped unless they are `Raw`."""
    def cell(v: Any) -> str:
        return v.html if isinstance(v, Raw) else esc(fmt(v))

    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    # the wrapper scrolls sideways: Gradio's container hides what overflows it, so a wide
    # table on a phone was cut off with no way to see its last columns
    return (f'<div class="ngs-table-wrap"><table class="ngs-table {elem_class}"><thead><tr>'
            f"{head}</tr></thead><tbody>{body}</tbody></table></div>")


class Raw:
    """Trusted HTML for `table` cells."""

    def __init__(self, html_text: str) -> None:
        self.html = html_text


def notice(text: str, kind: str = "info") -> str:
    return f'<div class="ngs-notice ngs-{kind}">{esc(text)}</div>'


FAVICON = Path(__file__).resolve().parent / "favicon.svg"

CSS = """
/* Gradio's bundled Source Sans Pro SemiBold holds a handful of glyphs (space, A, B), and the
   theme declares the family at weights 400 and 600 only, so every bold text (600: buttons,
   headings; 700: b, strong, th) takes that face: its A and B came from it, the other letters
   from a fallback font, and "A is better", "B is better", "Accounts" looked as if their
   first letter were smaller. Bold text takes one font for every letter. */
.gradio-container :is(button, h1, h2, h3, h4, h5, h6, b, strong, th, .ngs-side-label) {
  font-family: ui-sans-serif, system-ui, sans-serif !important; }
.ngs-pair { display: flex; gap: 16px; justify-content: center; }
/* the pair, its vote buttons and the reveal under them fit a laptop's screen (1366x768):
   images as tall as the window leaves room for, never under 220 px nor over 520 px */
.ngs-side { flex: 1 1 0; max-width: clamp(220px, calc(100vh - 420px), 520px);
  text-align: center; }
.ngs-side img, .ngs-pixel { image-rendering: pixelated; image-rendering: crisp-edges; }
.ngs-side img { width: 100%; aspect-ratio: 1 / 1; object-fit: contain; background: #fff;
  border: 1px solid #d4d4d8; border-radius: 6px; }
/* a phone: Gradio stacked the five vote buttons one a row (each at least 160 px wide) under
   the pair's 300 px minimum, which its 150 px images leave half empty, so at 375x667 Both bad
   and Skip, and the reveal after a vote, lay below the fold: an annotator scrolled down for
   every skip and back up for the next pair. Two buttons a row and the pair as tall as its
   images keep the pair and all five buttons on that screen, and the reveal too at 390x844 */
@media (max-width: 640px) {
  #arena-pair .html-container { min-height: 0 !important; }
  #arena-buttons { gap: 8px !important; }
  #arena-buttons > .ngs-vote { flex: 1 1 calc(50% - 8px) !important; min-width: 0 !important; }
}
/* "No pairs left": nothing on screen to judge, so the vote buttons look and act disabled
   (they stayed coloured and did nothing visible); the page looks for new pairs by itself */
body:has(#arena-pair .ngs-empty) #arena-buttons > .ngs-vote {
  opacity: 0.4; pointer-events: none; filter: grayscale(1); }
.ngs-side-label { font-weight: 700; font-size: 1.1em; margin: 4px 0; }
.ngs-prompt { font-size: 1.35em; text-align: center; margin: 6px 0 10px; }
.ngs-counters { text-align: center; color: #52525b; }
/* a vote's reveal shows for a few seconds, then fades. Gradio patches the reveal in place,
   and an animation that has run does not run again for new content: reveals alternate
   between two identical fades (app.ui.arena.reveal_html), and a changed animation-name
   starts the animation over */
.ngs-reveal { text-align: center; animation: ngs-fade-0 3.5s forwards; font-size: 0.92em;
  background: #fefce8; border: 1px solid #fde68a; border-radius: 6px; padding: 4px 8px; }
.ngs-reveal.ngs-reveal-1 { animation-name: ngs-fade-1; }
@keyframes ngs-fade-0 { 0% { opacity: 1; } 70% { opacity: 1; } 100% { opacity: 0;
  visibility: hidden; } }
@keyframes ngs-fade-1 { 0% { opacity: 1; } 70% { opacity: 1; } 100% { opacity: 0;
  visibility: hidden; } }
.ngs-kbd { font-family: monospace; border: 1px solid currentColor; border-radius: 3px;
  padding: 0 4px; margin-left: 4px; opacity: 0.8; }
.ngs-progress { position: relative; height: 18px; background: #e4e4e7; border-radius: 4px;
  min-width: 120px; overflow: hidden; }
.ngs-progress-fill { height: 100%; background: #22c55e; transition: width .3s; }
/* the label ("1/30") stands over the fill in dark text with a light halo, in either theme:
   it took the page's text colour (the dark theme's is near white, on the light track), and
   on a bar a few percent full half of it lay on the green. The theme's text colour comes
   from a more specific rule than this one: hence !important */
.ngs-progress span { position: absolute; left: 6px; top: 0; z-index: 1; font-size: 12px;
  line-height: 18px; font-weight: 600; color: #18181b !important;
  text-shadow: 0 0 2px #fff, 0 0 2px #fff, 0 0 3px #fff; white-space: nowrap; }
.ngs-table-wrap { max-width: 100%; overflow-x: auto; -webkit-overflow-scrolling: touch; }
.ngs-table { border-collapse: collapse; width: 100%; font-size: 0.92em; }
.ngs-table th, .ngs-table td { border-bottom: 1px solid #e4e4e7; padding: 4px 6px;
  text-align: left; vertical-align: middle; }
.ngs-group { display: flex; gap: 6px; align-items: flex-start; overflow-x: auto;
  padding: 6px 0; border-bottom: 1px solid #e4e4e7; }
.ngs-group-head { font-size: 0.9em; margin-top: 8px; }
.ngs-member { text-align: center; font-size: 11px; min-width: 76px; }
.ngs-member img { width: 72px; height: 72px; image-rendering: pixelated;
  border: 2px solid transparent; border-radius: 4px; }
.ngs-member img.ngs-thumb { image-rendering: auto; object-fit: cover; }
.ngs-member.anchor img { border-color: #f59e0b; }
.ngs-member summary { list-style: none; cursor: pointer; }
.ngs-member summary::-webkit-details-marker { display: none; }
.ngs-member .ngs-details { text-align: left; background: #f4f4f5; border-radius: 4px;
  padding: 3px; margin-top: 2px; }
.ngs-plot { background: #fff; border: 1px solid #e4e4e7; border-radius: 6px; margin: 3px; }
.ngs-plot-title { font: 600 12px sans-serif; }
.ngs-tick, .ngs-plot-empty { font: 10px sans-serif; fill: #52525b; }
.ngs-axis { stroke: #a1a1aa; stroke-width: 1; }
.ngs-band { fill: #93c5fd; opacity: 0.45; }
.ngs-plots { display: flex; flex-wrap: wrap; }
/* a message or count line that repeats what was typed (a 20,000-character prompt filter)
   breaks anywhere rather than run off the right edge */
.ngs-notice, .ngs-field-error, #rollouts-count, .ngs-group-head { overflow-wrap: anywhere; }
.ngs-notice { padding: 6px 10px; border-radius: 6px; margin: 4px 0; }
.ngs-info { background: #eff6ff; } .ngs-ok { background: #f0fdf4; }
.ngs-error { background: #fef2f2; color: #991b1b; }
.ngs-field-error { color: #b91c1c; font-size: 0.85em; }
/* a form field whose error shows beside it (app.ui.jobs) takes the red border that Gradio
   gives a number out of its range: the text fields (prompts, reward_weights) had none */
.ngs-field:has(.ngs-field-error) :is(input, textarea) {
  border-color: var(--error-border-color) !important; }
/* the header (title, who is logged in, Log out) on a phone: the row wraps instead of
   squeezing the title until its words break, and Log out stays a small button */
#ngs-header { flex-wrap: wrap; align-items: center; row-gap: 4px; }
#ngs-title { flex: 0 0 auto !important; min-width: 0 !important; width: auto !important;
  max-width: 100%; }
#ngs-title h2 { overflow-wrap: normal; word-break: normal; hyphens: none; margin: 0; }
#login-status { flex: 1 1 12em !important; min-width: 0 !important; }
#logout { flex: 0 0 auto !important; width: auto !important; min-width: 0 !important;
  align-self: center; }
/* the "(?)" that says a field has help (its tooltip): the label of every kind of field, a
   number's, a dropdown's, a radio's (block-info) and a checkbox's (label-text) */
.ngs-help label > span:first-child::after, .ngs-help .label-wrap span::after,
.ngs-help [data-testid="block-info"]::after, .ngs-help .checkbox-container .label-text::after {
  content: " (?)"; opacity: .55; cursor: help; }
"""

# keyboard shortcuts for the arena, the double-click guard, client vote ids, tooltips
HEAD = """
<link rel="icon" type="image/svg+xml" href="/favicon.ico">
<script>
(() => {
  const KEYS = __VOTE_KEYS__;  // key -> vote button id: page_head fills it from arena.KEYS
  function visible(el) { return el && el.offsetParent !== null; }
  document.addEventListener("keydown", (e) => {
    const t = e.target;
    if (t && (t.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(t.tagName))) return;
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const id = KEYS[e.key];
    if (!id) return;
    const btn = document.getElementById(id);
    if (!visible(btn)) return;
    e.preventDefault();
    if (e.repeat) return;
    btn.click();
  }, true);
  function shownNonce() {
    const pair = document.querySelector("#arena-pair .ngs-pair");
    return pair ? pair.dataset.nonce : "";
  }
  // the second click of a double click never reaches a vote button; every other click notes
  // which button it was and which pair was on screen at that moment. The arena's one
  // listener reads the notes later than the click (its script runs asynchronously, and a
  // click made while the previous vote's event is still prefetching waits for that event):
  // it takes the first click on the pair on screen then; later clicks on that pair are
  // repeats, clicks on pairs since replaced are stale (ngsVoteMeta)
  window.ngsClicks = [];
  window.addEventListener("click", (e) => {
    const b = e.target.closest && e.target.closest(".ngs-vote");
    if (!b) return;
    // a mouse click leaves the button focused, and Enter would then click it again: the same
    // vote on the next pair, unseen (a key's click, detail 0, never focused it). The second
    // click of a double click focuses it again (its mousedown) and is stopped below, so it
    // lets go of the focus too: after a double click Enter voted on the next pair
    if (e.detail >= 1) b.blur();
    if (e.detail > 1) { e.stopImmediatePropagation(); e.preventDefault(); return; }
    if (b.id && b.id.startsWith("vote-")) {
      window.ngsClicks.push({outcome: b.id.slice(5), nonce: shownNonce()});
    }
  }, true);
  function uuid() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    const b = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  }
  // one client vote id per pair on screen: a repeated vote on the same pair reuses it, so
  // the server records it once
  window.ngsVoteMeta = () => {
    const shown = shownNonce(), clicks = window.ngsClicks;
    window.ngsClicks = [];
    // no click on the pair on screen: a stale one goes to the server, which ignores it; no
    // click at all (the event before took it): no outcome, nothing to record
    const click = clicks.find((c) => c.nonce === shown) || clicks[0] || {nonce: shown};
    const nonce = click.nonce;
    window.ngsPerf = window.ngsPerf || {};
    window.ngsPerf.clickAt = performance.now();
    if (!window.ngsVote || window.ngsVote.nonce !== nonce) window.ngsVote = {nonce, id: uuid()};
    // shown: the pair on screen now, so that the server tells a repeat (the page already
    // shows the pair after the one clicked) from a page out of step with it
    return JSON.stringify({client_vote_id: window.ngsVote.id, nonce, shown,
                           outcome: click.outcome === undefined ? null : click.outcome});
  };
  // help text as tooltips: fields render lazily (hidden tabs), so apply on every change
  window.ngsHelp = {};
  function applyTips() {
    for (const [name, text] of Object.entries(window.ngsHelp)) {
      const el = document.getElementById("cfg-" + name);
      if (el && el.title !== text) el.title = text;
    }
  }
  window.ngsTooltips = (help) => { Object.assign(window.ngsHelp, help); applyTips(); };
  // a page whose login is no longer its browser's (Log out or another login in another tab,
  // the session cookie expired): the server refuses each of its events (app/ui/sessions.py),
  // which Gradio showed as red "Error" toasts and badges on every tab, under "Logged in as".
  // The page reloads once instead: the browser's login as it now is, or the login box, which
  // says why (login_ended: app.ui.login's restore). Not more than once a minute: never a loop
  const fetch0 = window.fetch;
  window.fetch = async (...args) => {
    const response = await fetch0(...args);
    const url = String((args[0] && args[0].url) || args[0]);
    if (response.status === 401 && url.includes("/gradio_api/queue/join")) {
      let detail = "";
      try { detail = (await response.clone().json()).detail; } catch (e) { /* not ours */ }
      const last = Number(sessionStorage.getItem("ngsLoginEndedAt") || 0);
      if (detail === __LOGIN_NOT_THIS_BROWSERS__ && Date.now() - last > 60000) {
        sessionStorage.setItem("ngsLoginEndedAt", String(Date.now()));
        location.replace(location.pathname + "?login_ended=1");
      }
    }
    return response;
  };
  // a tab out of sight for a while lets go of its event stream and takes it back when shown
  // (app.ui.keep_event_stream_open says why it is held and what holding it costs)
  let pauseTimer = null, streamPaused = false;
  document.addEventListener("visibilitychange", () => {
    clearTimeout(pauseTimer);
    if (document.visibilityState === "hidden") {
      pauseTimer = setTimeout(() => {
        const pause = document.getElementById("ngs-stream-pause");
        if (pause) { streamPaused = true; pause.click(); }
      }, window.ngsStreamPauseMs || __STREAM_PAUSE_MS__);
    } else if (streamPaused) {
      streamPaused = false;
      const resume = document.getElementById("ngs-stream-resume");
      if (resume) resume.click();
    }
  });
  let pending = false;
  new MutationObserver(() => {
    if (pending || !Object.keys(window.ngsHelp).length) return;
    pending = true;
    setTimeout(() => { pending = false; applyTips(); }, 100);
  }).observe(document.documentElement, {childList: true, subtree: true});
})();
</script>
"""


def page_head(vote_keys: Mapping[str, str], stream_pause_ms: int) -> str:
    """HEAD with the arena's shortcuts bound: each outcome's key, as its button shows it
    ("space": the space bar), clicks the button of id vote-<outcome>; a tab out of sight for
    `stream_pause_ms` lets go of its event stream; a page whose login the server no longer
    takes for its browser's reloads."""
    from app.ui.sessions import SESSION_NOT_THIS_BROWSERS

    keys = {" " if key == "space" else key: f"vote-{outcome}" for outcome, key in vote_keys.items()}
    return (HEAD.replace("__VOTE_KEYS__", json.dumps(keys))
            .replace("__STREAM_PAUSE_MS__", str(int(stream_pause_ms)))
            .replace("__LOGIN_NOT_THIS_BROWSERS__", json.dumps(SESSION_NOT_THIS_BROWSERS)))



def field_error(messages: str | list[str] | None) -> str:
    """The error box under a form field: its problems, one a line (empty: none)."""
    if not messages:
        return ""
    lines = [messages] if isinstance(messages, str) else messages
    return f'<div class="ngs-field-error">{"<br>".join(esc(m) for m in lines)}</div>'

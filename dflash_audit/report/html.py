"""``report.html``: one self-contained page; differing attention masks as pictures.

Each mask picture is a PNG (Pillow) embedded as a ``data:`` URI: rows are the Q = A*B draft
queries, columns the T context positions then the Q block positions (a grey line marks T).
Candidate and reference: dark = may attend (blue in the context part, green in the block
part), white = masked. Difference: red = only the candidate attends, blue = only the
reference attends, light grey = both attend. Masks taller than :data:`MAX_ROWS` rows are
cropped to the blocks around the first difference (the caption says which rows).
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_audit.report.markdown import (
    fmt_num,
    framework_lines,
    latent_lines,
    reference_rows,
    sandbox_rows,
)
from dflash_audit.report.schema import MaskPicture, Report

MAX_ROWS = 256
MAX_PICTURES = 8
_WHITE = (255, 255, 255)
_CONTEXT = (31, 78, 121)
_BLOCK = (46, 125, 50)
_BOTH = (200, 200, 200)
_ONLY_CAND = (220, 30, 30)
_ONLY_REF = (30, 90, 230)
_BOUNDARY = (150, 150, 150)

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem;color:#222;
max-width:1200px;line-height:1.4}
h1 .pass{color:#1a7f37}h1 .fail{color:#cf222e}
.scroll{overflow-x:auto;margin:.5rem 0 1.5rem}
table{border-collapse:collapse}td,th{border:1px solid #d0d7de;
padding:.25rem .5rem;text-align:left;vertical-align:top;font-size:.9rem}th{background:#f6f8fa}
td{overflow-wrap:break-word}td:last-child{min-width:14rem}
td code{overflow-wrap:break-word}.kv td{overflow-wrap:anywhere}
.pass{color:#1a7f37}.fail{color:#cf222e;font-weight:600}.warn{color:#9a6700}
code{background:#f6f8fa;padding:0 .2rem;border-radius:3px;overflow-wrap:anywhere}
figure{display:inline-block;margin:.5rem 1rem .5rem 0;vertical-align:top;max-width:100%}
figure img{image-rendering:pixelated;border:1px solid #d0d7de;max-width:100%;height:auto}
figcaption{font-size:.8rem;color:#555}.masks{margin-bottom:1.5rem}
details{margin:.3rem 0}summary{cursor:pointer}
@media (max-width:700px){body{margin:.75rem;font-size:.95rem}h1{font-size:1.4rem}
h2{font-size:1.2rem}h3{font-size:1rem}figure{display:block;margin:.5rem 0}
td,th{font-size:.8rem;padding:.2rem .35rem}}
@media print{body{margin:0;max-width:none;font-size:10pt}.scroll{overflow:visible}
h2,h3{break-after:avoid}tr,figure,li{break-inside:avoid}
figure{margin:.2cm .3cm .2cm 0}figure img{max-height:6.5cm;width:auto}summary{list-style:none}
details::details-content{content-visibility:visible;display:block}
details>*{display:block}a{color:inherit;text-decoration:none}}
"""


# ------------------------------------------------------------------------ pictures
def _png(rgb: np.ndarray, scale: int) -> str:
    """An RGB uint8 array [rows, cols, 3] as a base64 PNG data URI, upscaled ``scale`` x."""
    from PIL import Image

    img = Image.fromarray(rgb, "RGB")
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _as_bool(mask: Any) -> np.ndarray | None:
    if mask is None:
        return None
    t = torch.as_tensor(mask)
    return t.reshape(t.shape[-2], t.shape[-1]).bool().numpy()


def mask_rgb(mask: np.ndarray, seq_len: int) -> np.ndarray:
    """[R, C] bool mask -> [R, C, 3] uint8 picture (see module docstring)."""
    rgb = np.empty((*mask.shape, 3), dtype=np.uint8)
    rgb[:] = _WHITE
    ctx = np.zeros(mask.shape, dtype=bool)
    ctx[:, :seq_len] = True
    rgb[mask & ctx] = _CONTEXT
    rgb[mask & ~ctx] = _BLOCK
    if 0 < seq_len < mask.shape[1]:
        rgb[~mask[:, seq_len], seq_len] = _BOUNDARY
    return rgb


def diff_rgb(cand: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Difference picture of two same-shape bool masks (see module docstring)."""
    rgb = np.empty((*cand.shape, 3), dtype=np.uint8)
    rgb[:] = _WHITE
    rgb[cand & ref] = _BOTH
    rgb[cand & ~ref] = _ONLY_CAND
    rgb[~cand & ref] = _ONLY_REF
    return rgb


def _crop_rows(pic: MaskPicture, cand: np.ndarray | None, ref: np.ndarray | None
               ) -> tuple[int, int]:
    rows = max(m.shape[0] for m in (cand, ref) if m is not None)
    if rows <= MAX_ROWS:
        return 0, rows
    start = 0
    if cand is not None and ref is not None and cand.shape == ref.shape:
        differing = np.nonzero((cand != ref).any(axis=1))[0]
        if differing.size:
            start = int(differing[0]) // pic.block_size * pic.block_size
    start = max(0, min(start, rows - MAX_ROWS))
    return start, start + MAX_ROWS


def mask_figures(pic: MaskPicture, labels: tuple[str, str] = ("candidate", "reference")
                 ) -> str:
    """HTML of the candidate / reference / difference pictures of one mask (``labels``: what
    the two sides are called, e.g. ``("served", "trained")``)."""
    cand, ref = _as_bool(pic.candidate), _as_bool(pic.reference)
    r0, r1 = _crop_rows(pic, cand, ref)
    cols = max(m.shape[1] for m in (cand, ref) if m is not None)
    scale = max(1, min(4, 900 // max(cols, 1)))
    figs = []
    for label, m in zip(labels, (cand, ref), strict=True):
        if m is None:
            figs.append(f"<figure><figcaption>{label}: no mask produced</figcaption></figure>")
            continue
        src = _png(mask_rgb(m[r0:r1], pic.seq_len), scale)
        figs.append(f'<figure><img alt="{label} mask" src="{src}">'
                    f"<figcaption>{label} {list(m.shape)}</figcaption></figure>")
    if cand is not None and ref is not None and cand.shape == ref.shape:
        d = cand[r0:r1] != ref[r0:r1]
        src = _png(diff_rgb(cand[r0:r1], ref[r0:r1]), scale)
        figs.append(f'<figure><img alt="difference" src="{src}">'
                    f"<figcaption>difference: {int(d.sum())} entries (red: only {labels[0]} "
                    f"attends, blue: only {labels[1]})</figcaption></figure>")
    elif cand is not None and ref is not None:
        figs.append(f"<figure><figcaption>shapes differ: {labels[0]} {list(cand.shape)}, "
                    f"{labels[1]} {list(ref.shape)}</figcaption></figure>")
    rows_note = f", rows {r0}..{r1 - 1}" if (r0, r1) != (0, max(
        m.shape[0] for m in (cand, ref) if m is not None)) else ""
    title = (f"<h3>{html.escape(pic.layer_type)} on <code>{html.escape(pic.case)}</code> "
             f"(T={pic.seq_len}, B={pic.block_size}{rows_note})"
             f"{' — differs' if pic.differs else ''}</h3>")
    return f'<div class="masks">{title}{"".join(figs)}</div>'


# ---------------------------------------------------------------------------- page
def _status(s: str) -> str:
    return f'<span class="{html.escape(s)}">{html.escape(s)}</span>'


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    attr = f' class="{cls}"' if cls else ""
    return f'<div class="scroll"><table{attr}><tr>{head}</tr>{body}</table></div>'


def _e(x: Any) -> str:
    return html.escape(str(x))


def _per_case(diagnosis: dict) -> str:
    """A merged cause's per-case numbers, folded (one cause, one bullet)."""
    per_case = diagnosis.get("per_case") or {}
    if not per_case:
        return ""
    items = "".join(f"<li><code>{_e(c)}</code>: {_e(text)}</li>" for c, text in per_case.items())
    return f"<details><summary>per case</summary><ul>{items}</ul></details>"


def render_html(report: Report) -> str:
    """The text of ``report.html``."""
    v = report.verdict
    ref, cand, prof, inp = report.reference, report.candidate, report.profile, report.inputs
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             "<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>dflash-audit: {v}</title><style>{CSS}</style></head><body>",
             f"<h1>dflash-audit compare: <span class='{v}'>{v.upper()}</span></h1>",
             f"<p>Candidate <b>{_e(cand.get('name'))}</b> "
             f"(<code>{_e(cand.get('spec') or 'default')}</code>, fingerprint "
             f"<code>{_e(str(cand.get('fingerprint'))[:16])}</code>) vs reference "
             f"<code>{_e(ref.get('spec'))}</code> under profile <b>{_e(prof.get('name'))}</b> "
             f"(fingerprint <code>{_e(str(prof.get('fingerprint'))[:16])}</code>). "
             f"{len(report.cases)} cases; created {_e(report.created_at)}.</p>"]
    rows = [[_e(c["name"]), _status(c["status"]),
             f"{c['passed']} / {c['failed']} / {c['warned']}",
             _e(fmt_num(c["worst_max_abs_diff"])), _e(fmt_num(c["worst_max_rel_diff"])),
             (f"<code>{_e(c['first_failure']['case'])}</code>: {_e(c['first_failure']['summary'])}"
              if c["first_failure"] else "")] for c in report.checks()]
    summary, proof = sandbox_rows(report)
    if summary:
        parts.append(f"<p>{_e(summary)}</p>")
    if proof:
        parts.append("<details><summary>What the sandbox proved</summary>" + _table(
            ["property", "holds", "evidence"], [[_e(n), _e(ok), _e(ev)] for n, ok, ev in proof])
            + "</details>")
    framework = framework_lines(report)
    if framework:
        parts.append("<h2>Framework</h2><ul>" + "".join(f"<li>{_e(line)}</li>"
                                                        for line in framework) + "</ul>")
    latent = latent_lines(report)
    if latent:
        parts.append("<h2>Latent differences</h2><p>What the framework would do on input it "
                     "cannot express (warnings; the verdict does not count them).</p><ul>"
                     + "".join(f"<li>{_status('warn')} {_e(line)}</li>" for line in latent)
                     + "</ul>")
    parts += ["<h2>Checks</h2>", _table(["check", "status", "results ✓ / ✗ / ⚠", "worst max abs",
                                         "worst max rel", "first failure"], rows)]
    diagnoses = report.diagnoses()
    if diagnoses:
        parts.append("<h2>Diagnoses</h2><ul>" + "".join(
            f"<li>{_status(d['status'])} {_e(d['cause'])} — checks {_e(', '.join(d['checks']))}; "
            f"cases {_e(', '.join(d['cases'][:6]))}{' …' if len(d['cases']) > 6 else ''}"
            f"{_per_case(d)}</li>" for d in diagnoses) + "</ul>")
    pictures = [p for p in report.masks if p.differs][:MAX_PICTURES]
    parts.append("<h2>Attention masks</h2>")
    if pictures:
        parts.append(f"<p>{sum(p.differs for p in report.masks)} mask(s) differ; the first "
                     f"{len(pictures)} are shown.</p>")
    elif not any(r.name == "mask" for r in report.results):  # e.g. every case failed to run
        parts.append("<p>No mask was compared (no case has both sides' outputs).</p>")
    else:
        pictures = report.masks[:2]
        parts.append("<p>No mask differs between candidate and reference"
                     + ("; examples:" if pictures else ".") + "</p>")
    parts += [mask_figures(p) for p in pictures]
    parts.append("<h2>Cases</h2>")
    for case in report.cases:
        res_rows = [[_e(r.name), _status(r.status), _e(r.summary), _e(fmt_num(r.max_abs_diff)),
                     _e(fmt_num(r.max_rel_diff)), _e(r.first_diff or ""),
                     _e("; ".join(r.diagnosis))] for r in case.results]
        parts.append(f"<details><summary><code>{_e(case.name)}</code> {_status(case.status)} — "
                     f"{_e(case.description)}</summary><p>{_e(case.layout)}</p>"
                     + _table(["check", "status", "summary", "max abs", "max rel", "first diff",
                               "diagnosis"], res_rows) + "</details>")
    parts += ["<h2>Reference</h2>", _table(["field", "value"], [
        [_e(k), _e(val.strip("`"))] for k, val in reference_rows(ref)], "kv")]
    parts += ["<h2>Inputs and profile</h2>", _table(["field", "value"], [
        [_e(k), _e(val)] for k, val in {**inp, "profile": prof.get("fields")}.items()], "kv")]
    notes = [n for n in report.notes if n not in framework]
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes)
                     + "</ul>")
    if report.timing:
        parts += ["<h2>Timing</h2>", _table(["stage", "seconds"], [
            [_e(k), f"{val:.2f}"] for k, val in report.timing.items()])]
    parts.append(f"<p><small>report fingerprint <code>{report.fingerprint}</code></small></p>"
                 "</body></html>")
    return "\n".join(parts)


def write_html(report: Report, folder: Path) -> Path:
    """Write ``folder/report.html``; returns its path."""
    path = Path(folder) / "report.html"
    path.write_text(render_html(report))
    return path

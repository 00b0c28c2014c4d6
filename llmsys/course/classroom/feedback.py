"""A student's grade report as one standalone HTML page (no scripts, no links out).

Every text in it that a submission could have produced (error messages, hints,
written answers, notes) is escaped, so a student's output cannot become markup
in the browser of whoever opens the page.
"""

from __future__ import annotations

import html
from pathlib import Path

STATUS_COLOURS = {"passed": "#1a7f37", "scored": "#1a7f37", "failed": "#cf222e", "not run": "#cf222e",
                  "pending": "#9a6700", "skipped": "#57606a"}
STYLE = """body{font-family:system-ui,sans-serif;max-width:52em;margin:2em auto;padding:0 1em;color:#1f2328}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #d0d7de;padding:.4em;text-align:left;vertical-align:top}
.status{font-weight:600}pre{white-space:pre-wrap;background:#f6f8fa;padding:.5em;margin:.3em 0}"""


def feedback_html(report: dict) -> str:
    """The page for one report (a dict as ``GradeReport.to_dict`` gives it, or as in ``grade --json``)."""
    e = lambda value: html.escape(str(value), quote=True)  # noqa: E731
    lab = report.get("lab") or "?"
    rows = []
    for check in report["checks"]:
        status = check["status"]
        earned = "–" if status in ("skipped", "pending") else check["score"]
        kind = " (written answer)" if check.get("written") else " (hidden check)" if check.get("hidden") else ""
        detail = f"<pre>{e(check['message'])}</pre>" if check.get("message") else ""
        if check.get("written") and check.get("answer"):
            detail += f"<details><summary>your answer</summary><pre>{e(check['answer'])}</pre></details>"
        rows.append(f"<tr><td><code>{e(check['id'])}</code>{e(kind)}</td>"
                    f"<td class=status style=\"color:{STATUS_COLOURS.get(status, '#1f2328')}\">{e(status)}</td>"
                    f"<td>{e(earned)} / {e(check['points'])}</td><td>{detail}</td></tr>")
    notes = "".join(f"<li>{e(note)}</li>" for note in report.get("notes", []))
    pending = sum(c["status"] == "pending" for c in report["checks"])
    parts = [
        "<!DOCTYPE html>", "<html lang=en><head><meta charset=utf-8>",
        f"<title>{e(lab)}: feedback for {e(report['student'])}</title><style>{STYLE}</style></head><body>",
        f"<h1>{e(lab)}: {e(report['score'])} / {e(report['max_score'])} points</h1>",
        f"<p>Student: <b>{e(report['student'])}</b>. Submission sha256 <code>{e(report.get('sha256', ''))[:16]}</code>; "
        f"grading seed {e(report.get('salt'))}.</p>",
    ]
    if report.get("ungraded"):
        parts.append(f"<p><b>Not graded:</b> {e(report['ungraded'])}</p>")
    if pending:
        parts.append(f"<p>{pending} written answer(s) await the instructor's score; the total will change.</p>")
    parts += ["<table><tr><th>check</th><th>result</th><th>points</th><th>what the grader saw</th></tr>",
              *rows, "</table>"]
    if notes:
        parts.append(f"<h2>Notes</h2><ul>{notes}</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_feedback(reports: list[dict], out: str | Path) -> list[Path]:
    """OUT/<student>/<lab>.html for every graded report; the pages written."""
    out, written = Path(out), []
    for report in reports:
        if not report.get("lab"):
            continue  # an ungraded file has no lab to file it under; the grade table lists it
        if report["student"] in ("", ".", "..") or "/" in report["student"]:
            raise ValueError(f"student name {report['student']!r} cannot name a folder; rename the submission")
        page = out / report["student"] / f"{report['lab']}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(feedback_html(report), encoding="utf-8")
        written.append(page)
    return written

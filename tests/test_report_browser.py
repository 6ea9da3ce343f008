"""report.html in a real browser: headless Chromium (Debian's ``chromium``, installed by
``.ci/run``) opens the failing report of the gate test (a drafter with the ``kv <= anchor``
context rule, 2 synthetic cases) and the assertions read the RENDERED page through the DevTools
protocol: the verdict, every check row, the diagnoses, the mask pictures and that they load
(natural size > 0), a narrow screen without horizontal page scrolling, and print to PDF.

Screenshots (wide, narrow, print) are kept under pytest's temporary folder; their paths are
printed (``pytest -s``). Without chromium the tests skip, except in CI (``CI=true``), where its
absence fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from chromium_cdp import Browser
from gate_support import chromium, gate_run

from dflash_audit.limits import limit_s

pytestmark = pytest.mark.reference

WIDE, NARROW = (1280, 900), (390, 844)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = chromium()
    if path is None:
        if os.environ.get("DFLASH_AUDIT_TESTS_IN_CI") == "1":  # CI=true (conftest)
            pytest.fail("chromium is not installed, and CI=true: .ci/run installs it "
                        "(apt-get install -y chromium); the browser test must run in CI")
        pytest.skip("chromium is not installed (apt-get install -y chromium); "
                    "the browser test of report.html is skipped outside CI")
    return path


@pytest.fixture(scope="module")
def failing_report(tmp_path_factory) -> Path:
    run = gate_run("fail", tmp_path_factory.getbasetemp())
    assert run.rc == 1 and run.report_dir is not None, run.stdout + run.stderr
    return run.report_dir


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("report-browser")


@pytest.fixture(scope="module")
def browser(chromium_path, shots):
    with Browser(chromium_path, shots / "profile") as b:
        yield b


@pytest.fixture(scope="module")
def wide(browser, failing_report, shots):
    page = browser.open((failing_report / "report.html").as_uri(), *WIDE)
    print(f"\nscreenshot (wide): {page.screenshot(shots / 'report-wide.png')}")
    return page


@pytest.fixture(scope="module")
def narrow(browser, failing_report, shots):
    page = browser.open((failing_report / "report.html").as_uri(), *NARROW)
    print(f"\nscreenshot (narrow): {page.screenshot(shots / 'report-narrow.png')}")
    return page


def _section_js(title: str, selector: str) -> str:
    """JS: elements matching ``selector`` between the h2 ``title`` and the next h2."""
    return f"""(() => {{
      const h = [...document.querySelectorAll('h2')].find(e => e.innerText.trim() === {json.dumps(title)});
      if (!h) return null;
      const out = [];
      for (let e = h.nextElementSibling; e && e.tagName !== 'H2'; e = e.nextElementSibling)
        out.push(...(e.matches({json.dumps(selector)}) ? [e] : e.querySelectorAll({json.dumps(selector)})));
      return out;
    }})()"""


def test_verdict_is_shown_in_red(wide):
    assert wide.evaluate("document.querySelector('h1').innerText") == "dflash-audit compare: FAIL"
    assert wide.evaluate("getComputedStyle(document.querySelector('h1 .fail')).color") \
        == "rgb(207, 34, 46)"
    assert wide.evaluate("document.title") == "dflash-audit: fail"


def test_every_check_row_is_rendered(wide, failing_report):
    report = json.loads((failing_report / "report.json").read_text())
    rows = wide.evaluate(_section_js("Checks", "tr") +
                         ".slice(1).map(r => [...r.cells].map(c => c.innerText.trim()))")
    assert [r[0] for r in rows] == [c["name"] for c in report["checks"]]
    assert [r[1] for r in rows] == [c["status"] for c in report["checks"]]
    assert {r[0] for r in rows if r[1] == "fail"} == {"mask", "logits", "loss", "gradients"}
    mask_row = next(r for r in rows if r[0] == "mask")
    first_failing = next(r["case"] for c in report["cases"] for r in c["results"]
                         if r["name"] == "mask" and r["status"] == "fail")
    assert mask_row[2] == "0 / 2 / 0" and first_failing.startswith("syn-000-")
    assert first_failing in mask_row[5]
    visible = wide.evaluate(_section_js("Checks", "tr") +
                            ".every(r => r.getBoundingClientRect().height > 0)")
    assert visible is True


def test_diagnoses_are_rendered(wide, failing_report):
    report = json.loads((failing_report / "report.json").read_text())
    items = wide.evaluate(_section_js("Diagnoses", "li") + ".map(li => li.innerText)")
    assert len(items) == len(report["diagnoses"]) >= 2
    for item, diagnosis in zip(items, report["diagnoses"]):
        assert item.startswith(diagnosis["status"] + " " + diagnosis["cause"])
    assert items[0].startswith("fail context rule kv <= anchor")


def test_mask_pictures_load(wide):
    images = wide.evaluate("""[...document.querySelectorAll('.masks img')].map(i => ({
        alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight,
        shown: i.getBoundingClientRect().width}))""")
    # both layer types differ: candidate, reference and difference pictures for each
    assert [i["alt"] for i in images] == ["candidate mask", "reference mask", "difference"] * 2
    for img in images:
        assert img["complete"] and img["w"] > 0 and img["h"] > 0 and img["shown"] > 0, img
    titles = wide.evaluate("[...document.querySelectorAll('.masks h3')].map(h => h.innerText)")
    assert [t.split(" on ")[0] for t in titles] == ["full_attention", "sliding_attention"]
    assert all(t.endswith("differs") for t in titles)


def test_narrow_screen_has_no_horizontal_page_scroll(narrow):
    width = narrow.evaluate("window.innerWidth")
    assert width == NARROW[0]
    assert narrow.evaluate("document.documentElement.scrollWidth") <= width
    # pictures shrink to the screen; wide tables scroll inside their own box
    widest_img = narrow.evaluate(
        "Math.max(...[...document.images].map(i => i.getBoundingClientRect().right))")
    assert widest_img <= width
    boxes = narrow.evaluate("[...document.querySelectorAll('table')].map(t => "
                            "t.parentElement.getBoundingClientRect().right)")
    assert boxes and max(boxes) <= width
    assert narrow.evaluate("parseFloat(getComputedStyle(document.body).marginLeft)") < 20


def test_print_shows_the_cases_and_keeps_pictures_whole(browser, failing_report, shots):
    page = browser.open((failing_report / "report.html").as_uri(), *WIDE)
    page.send("Emulation.setEmulatedMedia", {"media": "print"})
    hidden = page.evaluate("[...document.querySelectorAll('details table')]"
                           ".filter(t => t.getBoundingClientRect().height === 0).length")
    assert hidden == 0, "print CSS must show the per-case tables of closed <details>"
    print(f"\nscreenshot (print media): {page.screenshot(shots / 'report-print.png')}")
    pdf = page.pdf(shots / "report-cdp.pdf")
    assert pdf.read_bytes().startswith(b"%PDF")


def test_print_to_pdf_from_the_command_line(chromium_path, failing_report, shots):
    pdf = shots / "report.pdf"
    subprocess.run([chromium_path, "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                    f"--user-data-dir={shots / 'profile-pdf'}", "--no-pdf-header-footer",
                    f"--print-to-pdf={pdf}", (failing_report / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=limit_s(120))
    data = pdf.read_bytes()
    print(f"\nPDF: {pdf} ({len(data)} bytes)")
    assert data.startswith(b"%PDF") and len(data) > 10_000
    pages = len(re.findall(rb"/Type\s*/Page\b(?!s)", data))
    assert 2 <= pages <= 12, pages

"""The HTML report in a real browser: Chromium (the distribution's package, headless) opens the page
built from the committed baselines and timelines from disk; every figure must be drawn (an SVG of
non-zero size with drawn paths) and the page must load nothing at all (no request, no broken
reference, no console error).

Where no Chromium is installed (a laptop) the test is skipped with the reason; under CI (`CI=true`)
a missing Chromium is a failure, since CI installs it (.ci/run). With HARNESS_REPORT_SCREENSHOTS=DIR
the screenshots of the figures are also kept in DIR (docs/ holds them as docs/report-*.png).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import pytest

from harness.spec.suite import BASELINES_DIR, CASES_DIR

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
# the kinds of figure the report draws: each must appear at least once on the committed baselines
KINDS = ("peaks-", "accuracy", "timeline-", "trend-", "depth", "claims")
SCREENSHOT_WIDTH = 900  # pixels: small enough for docs/
# One worker runs these tests under `-n 2 --dist loadgroup`: the worker of the case items, the one group
# this repository's scheduler keeps together (harness.pytest_plugin.xdist_groups.GROUP). Split over two
# workers, each built the report and started Chromium (its module fixtures): 21 s of setup in each.
IN_ONE_WORKER = pytest.mark.parametrize("_one_worker", [pytest.param(None, id="oom-harness-cases")])


def _missing(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI must install it (.ci/run: apt-get install -y chromium chromium-driver)")
    pytest.skip(f"{reason} (apt-get install chromium chromium-driver to run this test)")


def _browser_paths() -> tuple[str, str]:
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        _missing(f"no Chromium browser{'' if chromium else ' (chromium)'}"
                 f"{'' if driver else ' or driver (chromedriver)'} on PATH")
    return chromium, driver


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    from harness.report.html.build import build_report

    out = tmp_path_factory.mktemp("report")
    return build_report(out, BASELINES_DIR, CASES_DIR)


def _night(case_id: str, device_peak_gib: float, step_s: float) -> dict:
    """A full-size run record as `oom-harness run --json` writes it, on an H100 (a platform with baselines)."""
    import json

    from harness.measure.records import CaseRun, Memory, RankReport

    gib = 2**30
    rank = RankReport(case_id=case_id, fidelity="real", rank=0, world_size=1, platform="cuda",
                      device_name="NVIDIA H100 80GB HBM3",
                      step=Memory(allocated=int(0.9 * device_peak_gib * gib), device=int(device_peak_gib * gib)),
                      step_times_s=[9.0, step_s, step_s], tokens_per_step=16384)
    run = CaseRun(case_id=case_id, fidelity="real", command=[], returncode=0, wall_s=40.0, ranks=[rank])
    return {"case": case_id, "fidelity": "real", "variant": "", "run": json.loads(run.model_dump_json()),
            "verdicts": []}


@pytest.fixture(scope="module")
def night_page(tmp_path_factory) -> Path:
    """The report of a night with a run half as fast as its baseline (guide 003's r32 fix, 2,300 tokens/s
    blessed) and a run of a config the guide says runs out of memory that fits (guide 003's failing one)."""
    import json

    from harness.report.html.build import build_report

    out = tmp_path_factory.mktemp("night")
    runs = out / "night.json"
    runs.write_text(json.dumps([_night("003-qlora-fix-r32-seq1024-gc", 10.5, 14.0),
                                _night("003-qlora-failing-bs2-seq2048-r64", 12.0, 9.0)]))
    # the platform the runs measured on (its baselines pool the speed test's noise), without timelines
    shutil.copytree(BASELINES_DIR / "nvidia-h100-80gb-hbm3-x1", out / "baselines" / "nvidia-h100-80gb-hbm3-x1")
    return build_report(out / "html", out / "baselines", CASES_DIR, [runs], timeline_dirs=[])


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (the browser extra: pip install -e '.[browser]')")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.add_argument(f"--window-size={SCREENSHOT_WIDTH},1000")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def _requests(driver, page_url: str) -> list[str]:
    """The URLs asked for since the log was last read, from Chromium's network log: those of the page's
    document (the page itself included) and their failures, and any request to a network (http, https,
    ws) from whatever document, the browser's own start tab included."""
    import json

    ours, urls = set(), []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if params.get("documentURL") == page_url:
                ours.add(params["requestId"])
                urls.append(url)
            elif url.startswith(("http:", "https:", "ws:", "wss:")):
                urls.append(url)
        elif message["method"] == "Network.loadingFailed" and params.get("requestId") in ours:
            urls.append(f"FAILED {params.get('errorText')}")
    return urls


@IN_ONE_WORKER
def test_every_figure_is_drawn_and_nothing_is_fetched(page, browser, _one_worker):
    from selenium.webdriver.common.by import By

    url = page.resolve().as_uri()
    _requests(browser, url)  # what the browser loaded before the page (its start tab) is not the page's
    browser.get(url)
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")  # folded figures
    figures = browser.find_elements(By.CSS_SELECTOR, "figure.report-figure")
    keys = [f.get_attribute("id").removeprefix("fig-") for f in figures]
    assert len(figures) == page.read_text().count('class="report-figure"')
    assert all(any(k.startswith(kind) for k in keys) for kind in KINDS), keys
    for figure, key in zip(figures, keys, strict=True):
        svg = figure.find_element(By.CSS_SELECTOR, "svg")
        assert svg.size["width"] > 100 and svg.size["height"] > 50, f"{key}: SVG drawn {svg.size}"
        drawn = browser.execute_script(
            "const s = arguments[0]; const b = s.getBBox();"
            "const paths = [...s.querySelectorAll('path')].filter(p => (p.getAttribute('d') || '').length > 8);"
            "return {w: b.width, h: b.height, paths: paths.length, text: s.querySelectorAll('text').length};", svg)
        assert drawn["w"] > 0 and drawn["h"] > 0 and drawn["paths"] >= 10 and drawn["text"] > 0, f"{key}: {drawn}"
        caption = figure.find_element(By.CSS_SELECTOR, "figcaption").text
        assert "measured" in caption.lower(), f"{key}: the caption says nothing of what was measured"
    # nothing to load and nothing loaded: no element that fetches, one request (the page), no failure
    fetching = browser.execute_script(
        "return document.querySelectorAll('img, script, link, iframe, object, embed, video, audio, source').length")
    assert fetching == 0
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    requests = _requests(browser, url)
    assert requests == [url], requests
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


@IN_ONE_WORKER
def test_screenshots_of_each_kind_of_figure(page, browser, tmp_path, _one_worker):
    from PIL import Image
    from selenium.webdriver.common.by import By

    browser.get(page.resolve().as_uri())
    keep = os.environ.get("HARNESS_REPORT_SCREENSHOTS")
    for kind in KINDS:
        figure = browser.find_element(By.CSS_SELECTOR, f"figure[id^='fig-{kind}']")
        browser.execute_script("arguments[0].scrollIntoView()", figure)
        image = Image.open(io.BytesIO(figure.screenshot_as_png))
        assert image.width > 200 and image.height > 100
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 8, f"{kind}: the screenshot is blank"
        name = f"report-{re.sub(r'[^a-z]', '', kind)}.png"
        small = image.convert("RGB").quantize(colors=64)
        small.save(tmp_path / name, optimize=True)
        if keep:
            small.save(Path(keep) / name, optimize=True)


@IN_ONE_WORKER
def test_the_first_screen_is_the_verdict_table_with_the_failures(night_page, browser, _one_worker):
    """The first screen of the nightly: the verdict table, failures first, the regressed run and the
    refuted outcome among them, on a laptop's window and on a phone's 390 px."""
    from selenium.webdriver.common.by import By

    for width, height in ((SCREENSHOT_WIDTH, 1000), (390, 844)):
        browser.set_window_size(width, height)
        browser.get(night_page.resolve().as_uri())
        table = browser.find_element(By.ID, "verdict-table")
        rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
        statuses = [r.find_element(By.CSS_SELECTOR, "td").text for r in rows]
        assert statuses == sorted(statuses, key=["FAIL", "NOT CHECKED", "finding", "pass"].index)
        failed = {r.text for r in table.find_elements(By.CSS_SELECTOR, "tbody tr.fail")}
        regressed = next(t for t in failed if "003-qlora-fix-r32-seq1024-gc [run given]" in t)
        assert "tokens/s below the baseline beyond the noise" in regressed and "-48.5% (noise" in regressed
        refuted = next(t for t in failed if "003-qlora-failing-bs2-seq2048-r64 [run given]" in t)
        assert "outcome refuted: expected oom, measured fits" in refuted
        first = browser.execute_script(
            "const r = document.querySelector('#verdict-table tbody tr.fail').getBoundingClientRect();"
            "return [r.top, window.innerHeight, document.documentElement.scrollWidth, window.innerWidth];")
        assert first[0] < first[1], f"{width} px: the first failure is below the first screen ({first})"
        assert first[2] <= first[3] + 1, f"{width} px: the page scrolls sideways ({first})"
        text_px = browser.execute_script(
            "return parseFloat(getComputedStyle(document.querySelector('#verdict-table td')).fontSize)")
        assert text_px >= 10, f"{width} px: the table's text is {text_px} px"
        keep = os.environ.get("HARNESS_REPORT_SCREENSHOTS")
        if keep and width == SCREENSHOT_WIDTH:  # the first screen, as docs/report.md shows it
            from PIL import Image

            shot = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB").quantize(colors=64)
            shot.save(Path(keep) / "report-verdicts.png", optimize=True)
    browser.set_window_size(SCREENSHOT_WIDTH, 1000)

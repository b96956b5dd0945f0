"""The example pages as a researcher reaches them: a real `mlflow server` (SQLite, artifacts served), a
tiny fine-tuning run logging to it (the session's, tests/runs_testing.py), the run opened in the MLflow UI in a real headless Chromium (the
system's, tests/examples/conftest.py), its artifacts listed, the index shown by MLflow's artifact viewer
(a sandboxed frame): a card clicked draws its detail in place (no blank frame), filtering to the wrong
answers shows as many as the run's summary says, sorting by confidence orders the cards; the run's
description links the index, and following the link opens it. Screenshots go to $XMODAL_SCREENSHOTS
when set (for looking at them)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal.base import run_tags

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EXAMPLES = 6  # the run's (tests/runs_testing.py)


def colours(png: bytes) -> int:
    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 20) or [])


def shot(page, tmp_path: Path, name: str) -> bytes:
    png = page.screenshot(path=str(tmp_path / f"{name}.png"))
    if os.environ.get("XMODAL_SCREENSHOTS"):
        Path(os.environ["XMODAL_SCREENSHOTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / f"{name}.png", Path(os.environ["XMODAL_SCREENSHOTS"]) / f"{name}.png")
    return png


def test_a_run_s_example_pages_in_the_mlflow_ui(vqa_run, tmp_path, browser):
    uri, run_id = vqa_run.uri, vqa_run.run_id  # a real `mlflow server`
    run = tracking.get_run(uri, run_id)
    right = int(re.fullmatch(rf"{EXAMPLES} valid examples, (\d+) right", run.tags[run_tags.EXAMPLES_SUMMARY])[1])
    link = tracking.artifact_url(uri, run_id, "examples/index.html")
    assert f"[examples/index.html]({link})" in run.tags[run_tags.NOTE]

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # the run in the UI, its artifacts: the index in MLflow's artifact viewer, every example's card
    page.goto(tracking.run_url(uri, run_id))
    page.get_by_text("vqa", exact=True).first.wait_for(timeout=60_000)
    page.get_by_role("tab", name=re.compile("Artifacts")).click()
    page.get_by_text("examples", exact=True).first.click()
    page.get_by_text("index.html", exact=True).first.click()
    frame = page.frame_locator("iframe.mlflow-html-iframe")
    assert frame.locator("h1").inner_text(timeout=30_000) == "vqa examples of run vqa"
    assert frame.locator(".card").count() == EXAMPLES
    assert frame.locator(".card img").evaluate_all("els => els.every(e => e.complete && e.naturalWidth > 0)")
    assert colours(shot(page, tmp_path, "examples-mlflow-index")) > 50

    # a card: its detail drawn in place, the frame still the index (no navigation the sandbox blanks)
    frame.locator(".card").nth(1).click()
    frame.locator("#xm-detail h2").filter(has_text="Example").wait_for(timeout=30_000)
    assert frame.locator("#xm-detail .pic img").first.evaluate("e => e.complete && e.naturalWidth > 0")
    assert frame.locator("#xm-detail svg rect").count() > 0 and frame.locator("h1").count() == 1
    assert colours(shot(page, tmp_path, "examples-mlflow-detail")) > 50

    # triage: the wrong answers, as many as the run's summary says; by confidence, highest first
    frame.locator("#xm-f-verdict").select_option("wrong")
    assert frame.locator("#xm-count").inner_text() == str(EXAMPLES - right)
    assert frame.locator(".card").count() == EXAMPLES - right
    frame.locator("#xm-f-verdict").select_option("")
    frame.locator("#xm-sort").select_option("confidence:-1")
    data = json.loads(frame.locator("#xm-data").text_content())
    order = [c.get_attribute("data-id") for c in frame.locator(".card").all()]
    by_conf = {it["id"]: it["sorts"]["confidence"] for it in data["items"]}
    for group in ("wrong", "right"):  # each section sorted
        ids = [i for i in order if next(it for it in data["items"] if it["id"] == i)["facets"]["verdict"] == group]
        assert [by_conf[i] for i in ids] == sorted((by_conf[i] for i in ids), reverse=True)

    # the description's link opens the index (in a new tab, as MLflow opens the description's links)
    page.goto(tracking.run_url(uri, run_id))
    described = page.get_by_role("link", name="examples/index.html")
    with page.expect_popup() as opened:
        described.first.click()
    shown = opened.value.frame_locator("iframe.mlflow-html-iframe")
    assert shown.locator("h1").inner_text(timeout=30_000) == "vqa examples of run vqa"
    assert opened.value.url == link

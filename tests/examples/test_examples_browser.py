"""The example pages as a researcher reaches them: a real `mlflow server` (SQLite, artifacts served), a
tiny fine-tuning run logging to it, the run opened in the MLflow UI in a real headless Chromium (the
system's: scripts/setup.sh installs it with apt; Playwright drives it), its artifacts listed, the index
page and an example page opened at the address the run's description gives, and looked at."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import pytest

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.cli.jobs import end_of_run_pages
from xmodal.config.experiment import load_config
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.runner import engine
from xmodal_testing import MlflowServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EXAMPLES = 5


def chromium() -> str | None:
    """The system's Chromium (Playwright's own download is not used: it is unreachable in CI)."""
    return os.environ.get("XMODAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def colours(png: bytes) -> int:
    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 20) or [])


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (scripts/setup.sh installs it with apt)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_a_run_s_example_pages_in_the_mlflow_ui(tmp_path, ray_local, browser):
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions
    from xmodal.jobs.finetune_job import FinetuneJob

    server = MlflowServer(tmp_path).start()
    try:
        images = build_synthetic_store(tmp_path / "images", SyntheticLxmertOptions(
            num_images=48, num_objects=8, feat_dim=16, num_object_labels=10, num_attr_labels=4, num_answers=20))
        vqa = build_synthetic_vqa(images.path, tmp_path / "vqa", questions_per_image=2)
        result = engine.run(FinetuneJob(), load_config(FinetuneConfig, overrides=[
            f"data.store={vqa.path}", "init.source=scratch", "preset=tiny", f"mlflow.tracking_uri={server.uri}",
            f"scale.storage_path={tmp_path / 'runs'}", "mlflow.run_name=vqa", "train.epochs=1",
            "train.batch_size=16", "mlflow.system_metrics=false", "robust.conditions=[]",
            f"examples.count={EXAMPLES}"]), after_run=end_of_run_pages)
        run = tracking.get_run(server.uri, result.run_id)
        artifacts = re.search(r"examples/index\.html under the run's \[Artifacts\]\((http[^)]+)\)",
                              run.tags[run_tags.NOTE]).group(1)
        assert artifacts == f"{server.uri}/#/experiments/{run.experiment_id}/runs/{result.run_id}/artifacts"

        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        # the run in the UI, its artifacts: the pages' folder among them
        page.goto(tracking.run_url(server.uri, result.run_id))
        page.get_by_text("vqa", exact=True).first.wait_for(timeout=60_000)
        page.get_by_role("tab", name=re.compile("Artifacts")).click()
        page.get_by_text("examples", exact=True).first.click()

        # the index, shown by MLflow's artifact viewer: the summary and every example, pictures drawn
        page.get_by_text("index.html", exact=True).first.click()
        frame = page.frame_locator("iframe.mlflow-html-iframe")
        assert frame.locator("h1").inner_text(timeout=30_000) == "vqa examples of run vqa"
        assert frame.locator(".card").count() == EXAMPLES
        assert frame.locator(".card img").evaluate_all("els => els.every(e => e.complete && e.naturalWidth > 0)")
        assert colours(page.screenshot(path=str(tmp_path / "index.png"))) > 50

        # one example page: its picture drawn, and the word picker moves the attention shown
        page.get_by_text("example-0000.html", exact=True).first.click()
        frame = page.frame_locator("iframe.mlflow-html-iframe")
        frame.locator("h2").filter(has_text="Example 1 of").wait_for(timeout=30_000)
        assert frame.locator(".pic img").first.evaluate("e => e.complete && e.naturalWidth > 0")
        word = frame.locator(".tok-A").nth(1)  # the first word after [CLS]
        shown = frame.locator("#v-A-0-0").text_content()
        word.click()
        assert "on" in word.get_attribute("class").split()
        weights = json.loads(frame.locator("#att-A").text_content())
        last = len(weights["avg"]) - 1
        assert frame.locator("#v-A-0-0").text_content() == f"{weights['avg'][last][0][1][0]:.4f}"
        assert shown == f"{weights['avg'][last][0][0][0]:.4f}"
        assert colours(page.screenshot(path=str(tmp_path / "example.png"))) > 50
    finally:
        server.stop()

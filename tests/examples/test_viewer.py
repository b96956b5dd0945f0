"""The one-page viewer in a real headless Chromium, on pages made from examples built in memory (no model,
no MLflow: tests/examples/test_examples_browser.py opens a real run's pages inside MLflow's UI): the
attention drawn as the weights are (a uniform row uniform, a peaked one by its absolute weights), the
filters and sorts, the detail drawn in place without navigating, deep links, two runs side by side."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xmodal.examples.build import write_rendered
from xmodal.examples.pictures import Box, Picture
from xmodal.examples.qa import OUTLINE_GAIN, Example, QaRender
from xmodal.examples.run import Shown

pytestmark = pytest.mark.usefixtures("one_thread")

N = 6  # boxes


def example(i: int, row: list[float], pred: str, gold: str, p: float, loss: float) -> Example:
    boxes = [Box((0.05 + 0.15 * b, 0.1, 0.18 + 0.15 * b, 0.6 + 0.05 * b), obj=b, attr=b % 3, obj_conf=1.0,
                 attr_conf=1.0, label=f"obj {b}") for b in range(N)]
    att = np.full((2, 1, 2, 4, 8), 0.0, np.float32)  # 2 layers, 1 picture, 2 heads, 4 tokens, 8 box slots
    att[..., :N] = np.asarray(row, np.float32)
    return Example(row=i, id=f"q{i}", text=f"how many things number {i}?", tokens=["[CLS]", "how", "many", "[SEP]"],
                   pictures=[Picture(f"img{i}", 640, 480, boxes, "synthetic")], gold=[(gold, 1.0)], pred=pred,
                   top=[(pred, p), ("other", 1 - p)], score=float(pred == gold), attention=att, loss=loss)


UNIFORM = [1 / N] * N
PEAKED = [0.75, 0.05, 0.05, 0.05, 0.05, 0.05]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    a = [example(0, UNIFORM, "2", "2", 0.9, 0.1), example(1, PEAKED, "3", "2", 0.95, 2.0),
         example(2, UNIFORM, "yes", "no", 0.4, 1.0), example(3, PEAKED, "1", "1", 0.6, 0.5)]
    b = [example(0, PEAKED, "3", "2", 0.7, 1.5), example(1, UNIFORM, "2", "2", 0.8, 0.2),
         example(2, UNIFORM, "no", "no", 0.5, 0.7), example(3, UNIFORM, "1", "1", 0.9, 0.1)]
    root = tmp_path_factory.mktemp("viewer")
    sa = Shown("ra", "run-a", "finetune", "vqa", "valid", "/sets/vqa", a, 40)
    sb = Shown("rb", "run-b", "finetune", "vqa", "valid", "/sets/vqa", b, 40)
    for name, rendered in (("one", QaRender().render(sa)), ("two", QaRender().render(sa, sb))):
        (root / name).mkdir()
        write_rendered(rendered, root / name)
    return root


def strokes(page) -> list[float]:
    return page.locator("#xm-detail svg[data-side='A'] rect").evaluate_all(
        "els => els.map(e => +e.getAttribute('stroke-width'))")


def test_the_attention_is_drawn_as_the_weights_are(browser, pages):
    page = browser.new_page()
    page.goto((pages / "one" / "index.html").as_uri())
    page.locator(".card[data-id='q0']").click()  # a uniform row
    assert page.locator("#xm-detail h2").inner_text().startswith("Example 3 of 4")  # listed after the wrong ones
    assert strokes(page) == pytest.approx([1 + OUTLINE_GAIN / N] * N, abs=0.01)  # all the same: uniform
    xs = page.locator("#xm-detail .xm-x").all_inner_texts()
    assert xs == ["1.00"] * N
    assert f"entropy {math.log(N):.3f} nats" in page.locator("#xm-detail .xm-ent").inner_text()
    page.locator(".card[data-id='q1']").click()  # a peaked row: widths by the absolute weights
    assert strokes(page) == pytest.approx([1 + OUTLINE_GAIN * w for w in PEAKED], abs=0.01)
    assert page.locator("#xm-detail .xm-w").all_inner_texts()[0] == "0.7500"
    # the outlines grow outward from each box's own: inside it, the object and its label stay uncovered
    inner = page.locator("#xm-detail svg[data-side='A'] rect").evaluate_all(
        "els => els.map(e => [+e.getAttribute('x') + e.getAttribute('stroke-width') / 2, "
        "+e.getAttribute('y') + e.getAttribute('stroke-width') / 2])")
    boxes = page.evaluate("() => JSON.parse(document.getElementById('xm-data').textContent).items"
                          ".find(it => it.id === 'q1').data.sides[0].pics[0].rects")
    assert [v for xy in inner for v in xy] == pytest.approx([v for x, y, _, _ in boxes for v in (x + 1, y + 1)])
    assert page.url.endswith("#example=q1")  # selecting sets the deep link; the document is the same
    page.close()


def test_filters_sorts_and_deep_links(browser, pages):
    page = browser.new_page()
    page.goto((pages / "one" / "index.html").as_uri() + "#example=q2")
    assert "q2" in page.locator("#xm-detail h2").inner_text()  # the deep link selects
    page.select_option("#xm-f-verdict", "wrong")
    assert page.locator("#xm-count").inner_text() == "2" and page.locator(".card").count() == 2
    page.select_option("#xm-sort", "confidence:-1")  # confident and wrong first
    assert [c.get_attribute("data-id") for c in page.locator(".card").all()] == ["q1", "q2"]
    page.select_option("#xm-f-verdict", "")
    page.select_option("#xm-sort", "loss:-1")
    assert page.locator(".card").first.get_attribute("data-id") == "q1"  # wrong (first section), loss 2.0
    page.locator(".card[data-id='q1']").click()
    page.locator("#xm-next").click()
    assert "q2" in page.locator("#xm-detail h2").inner_text()  # next: the list's order
    page.close()


def test_two_runs_apart_and_their_pickers_together(browser, pages):
    page = browser.new_page()
    page.goto((pages / "two" / "index.html").as_uri())
    assert [c.get_attribute("data-id") for c in page.locator(".card").all()] == ["q0", "q1", "q2", "q3"]
    heads = page.locator("#xm-list h2").all_inner_texts()
    assert heads == ["only A right (1)", "only B right (2)", "both right (1)"]
    assert page.locator("#xm-2x2").inner_text().split() == ["B", "right", "B", "wrong", "A", "right", "1", "1", "A",
                                                          "wrong", "2", "0"]
    page.locator(".card[data-id='q0']").click()
    page.select_option("#xm-detail .xm-layer", "0")
    page.locator("#xm-detail .tok").nth(2).click()
    both = page.locator("#xm-detail svg rect").evaluate_all("els => els.map(e => e.parentNode.dataset.side)")
    assert both.count("A") == N and both.count("B") == N  # one picker row draws both runs
    b_widths = page.locator("#xm-detail svg[data-side='B'] rect").evaluate_all(
        "els => els.map(e => +e.getAttribute('stroke-width'))")
    assert b_widths == pytest.approx([1 + OUTLINE_GAIN * w for w in PEAKED], abs=0.01)
    page.close()

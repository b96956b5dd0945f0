"""The example pages' own options and checks, without a run: `examples.count` is a whole number (a YAML
`true` is not 1), `--examples` likewise, and two runs' examples must be the same examples: the first that
differs in id or content is named."""

from __future__ import annotations

import numpy as np
import pytest

from xmodal.config.experiment import ConfigError, load_config
from xmodal.examples.kinds import kind_of_task
from xmodal.examples.pictures import Picture
from xmodal.examples.qa import Example
from xmodal.examples.run import ExamplesError, Shown, check_count, check_same_examples, choose_rows
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.jobs.pretrain_config import PretrainConfig


@pytest.mark.parametrize("config", [FinetuneConfig, PretrainConfig])
@pytest.mark.parametrize("value", ["true", '"16"', "1.0", "-1", "1001"])
def test_examples_count_is_a_whole_number_in_range(config, value):
    with pytest.raises(ConfigError, match=r"examples\.count = .*: expected (a valid integer|an integer in \[0, 1000\])"):
        load_config(config, overrides=[f"examples.count={value}"])
    assert load_config(config, overrides=["examples.count=0"]).examples.count == 0


@pytest.mark.parametrize("n", [0, -1, 1001, True, 2.0, "3"])
def test_the_examples_option_is_a_whole_number_in_range(n):
    with pytest.raises(ExamplesError, match=r"--examples .*: expected a whole number of examples from 1 to 1000"):
        check_count(n)
    assert check_count(1) == 1 and check_count(1000) == 1000


def ex(i: str, text: str = "is there a cube?", gold: str = "yes", img: str = "img1") -> Example:
    return Example(row=0, id=i, text=text, tokens=["[CLS]"], pictures=[Picture(img, 10, 10, [], "blank")],
                   gold=[(gold, 1.0)], pred="yes", top=[("yes", 1.0)], score=1.0,
                   attention=np.zeros((1, 1, 1, 1, 1), np.float32))


def shown(run: str, examples: list[Example]) -> Shown:
    return Shown(run, run, "finetune", "vqa", "valid", f"/sets/{run}", examples, 10)


@pytest.mark.parametrize(("b", "said"), [
    ([ex("q1"), ex("q3")], "example 'q2' of run 'A' (/sets/A) differs from example 'q3' of run 'B' (/sets/B) "
                           "(id 'q2' against 'q3')"),
    ([ex("q1"), ex("q2", text="is there a ball?")], "example 'q2' of run 'A' (/sets/A) differs from example 'q2' of "
                                                   "run 'B' (/sets/B) (text 'is there a cube?' against 'is there a ball?')"),
    ([ex("q1"), ex("q2", gold="no")], "(gold answers (('yes', 1.0),) against (('no', 1.0),))"),
    ([ex("q1"), ex("q2", img="img9")], "(pictures ('img1',) against ('img9',))"),
    ([ex("q1")], "run 'A' shows 2 examples, run 'B' 1"),
])
def test_two_runs_examples_must_be_the_same_examples(b, said):
    a = shown("A", [ex("q1"), ex("q2")])
    with pytest.raises(ExamplesError) as caught:
        check_same_examples(a, shown("B", b))
    assert said in str(caught.value) and str(caught.value).startswith("--compare: ")
    check_same_examples(a, shown("B", [ex("q1"), ex("q2")]))  # the same examples: no error


def test_every_task_has_one_kind():
    assert {t: kind_of_task(t) for t in ("vqa", "gqa", "nlvr2", "pretrain", "mult", "retrieval")} == {
        "vqa": "finetune", "gqa": "finetune", "nlvr2": "finetune", "pretrain": "pretrain", "mult": "mult",
        "retrieval": None}


def test_a_larger_sample_holds_a_smaller_one():
    small, large = choose_rows(600, 16), choose_rows(600, 48)
    assert set(small) <= set(large) and len(set(large)) == 48 and list(large) == sorted(large)
    assert list(choose_rows(5, 48)) == [0, 1, 2, 3, 4]  # a split smaller than the count: all of it

"""Which trials run their one worker in the trial's own process, and what Tune reserves for them
(`xmodal.sweep.runner.in_process_trials`, `trial_resources`): decided from the planned space and
base config, before Ray starts."""

from __future__ import annotations

import textwrap

import pytest

from xmodal.jobs.registry import job_spec
from xmodal.sweep.plan import SweepOptions, plan_sweep
from xmodal.sweep.runner import TRIAL_RESOURCES, in_process_trials, trial_resources
from xmodal.sweep.space import validate_config
from xmodal_testing import REPO


def planned(tmp_path, space: str, *sets: str):
    plan = plan_sweep(SweepOptions(space=space, sets=list(sets), storage_path=str(tmp_path / "runs")))
    return plan.space, validate_config(job_spec(plan.space.job).config_class, plan.base, space)


def test_a_one_worker_trial_is_its_worker_and_holds_the_workers_resources(tmp_path):
    space, cfg = planned(tmp_path, str(REPO / "search_spaces" / "mult_ablation.yaml"), "scale.cpus_per_worker=1.5",
                         "scale.resources_per_worker={accelerator: 1}")
    assert in_process_trials(space, cfg)
    assert trial_resources(True, cfg) == {"CPU": 1.5, "accelerator": 1}


def test_a_gpu_worker_reserves_its_gpus_on_the_trial(tmp_path):
    space, cfg = planned(tmp_path, str(REPO / "search_spaces" / "mult_ablation.yaml"), "scale.gpus_per_worker=0.5")
    assert trial_resources(in_process_trials(space, cfg), cfg) == {"CPU": 0.5, "GPU": 0.5}


def test_trials_of_several_workers_or_a_searched_scale_start_ray_train_runs(tmp_path):
    space, cfg = planned(tmp_path, str(REPO / "search_spaces" / "mult_ablation.yaml"), "scale.num_workers=2")
    assert not in_process_trials(space, cfg)
    assert trial_resources(False, cfg) == TRIAL_RESOURCES  # the trial function only waits
    searched = tmp_path / "searched.yaml"
    searched.write_text(textwrap.dedent("""
        job: mult
        metric: valid/mae
        mode: min
        num_samples: 2
        scheduler: {type: fifo}
        parameters:
          scale.cpus_per_worker: {type: choice, values: [0.5, 1.0]}
        """))
    space, cfg = planned(tmp_path, str(searched))
    assert not in_process_trials(space, cfg)


@pytest.mark.parametrize("space", ["mult_ablation.yaml", "mult_depth.yaml", "lxmert_layers.yaml",
                                   "lxmert_tasks.yaml"])
def test_every_shipped_space_runs_its_trials_in_process(tmp_path, space):
    assert in_process_trials(*planned(tmp_path, str(REPO / "search_spaces" / space)))

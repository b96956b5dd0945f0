"""The console: evaluation tables, plain progress lines without a terminal, Ray's worker lines sorted
into events, messages, noise and the rest."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from xmodal.base import console
from xmodal.base.console import EVENT, Console, eval_table


@pytest.fixture
def active(monkeypatch):
    """A fresh active console in place of the module's (the package logger writes through it)."""
    c = Console()
    c.active = True
    monkeypatch.setattr(console, "CONSOLE", c)
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    handler = console._ConsoleHandler()
    handler.setFormatter(console._Formatter())
    log = logging.getLogger("xmodal")
    old = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield c
    log.removeHandler(handler)
    log.setLevel(old[0])
    log.propagate = old[1]


def test_eval_table_is_three_lines_in_the_jobs_order_with_baselines():
    metrics = {"eval/attr_acc": 0.42, "eval/loss": 9.19, "eval/loss/mlm": 1.63, "eval/mlm_acc": 0.474}
    text = eval_table(500, 2696, metrics, {"eval/mlm_acc": [0.115, "most frequent word"]},
                      order=["eval/loss", "eval/mlm_acc", "eval/attr_acc"])
    head, value, base = text.splitlines()
    assert head.split() == ["[xmodal]", "eval", "@", "step", "500/2696", "mlm_acc", "attr_acc", "loss"]
    assert value.split() == ["value", "0.4740", "0.4200", "9.1900"]  # per-task losses left to MLflow
    assert base.split() == ["chance/prior", "0.1150", "-", "-"]
    # columns line up under their names
    assert value.index("0.4740") + len("0.4740") == head.index("mlm_acc") + len("mlm_acc")


def test_wide_tables_wrap():
    metrics = {f"eval/t{i:02d}_acc": i / 10 for i in range(12)}
    lines = eval_table(1, 2, metrics, {}, width=80).splitlines()
    assert len(lines) == 4 and all(len(line) <= 80 for line in lines)  # two blocks of (names, values)
    assert sum(line.split().count("value") for line in lines) == 2


def test_without_a_terminal_progress_is_a_line_every_tenth(active, capsys):
    active.begin(1000, {}, [])
    for step in range(10, 1001, 10):
        active.event({"kind": "progress", "step": step, "epoch": 0, "loss": 1.5, "rate": 1234.0, "eta": 65.0})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 11, lines  # the first log step, then every tenth
    assert lines[0] == "[xmodal] step 10/1000 epoch 0  loss 1.5000  1,234 samples/s  ETA 1:05"
    assert lines[1].startswith("[xmodal] step 110/1000 ")
    assert "\r" not in "".join(lines)
    active.end()
    active.event({"kind": "eval", "step": 1000, "metrics": {"eval/acc": 0.5}})  # after the run: dropped
    assert capsys.readouterr().out == ""


def test_the_last_evaluation_is_awaited_when_its_line_comes_after_fit_returns(active, capsys):
    """Ray forwards worker lines asynchronously: the driver waits (bounded) for the final evaluation."""
    active.begin(100, {}, [])
    late = threading.Timer(0.3, active.event, [{"kind": "eval", "step": 100, "metrics": {"eval/acc": 0.9}}])
    late.start()
    active.settle(100, {"eval/acc": 0.9, "step": 100, "epoch": 1, "final": 1}, timeout_s=30)
    late.join()
    out = capsys.readouterr().out
    assert out.count("[xmodal] eval @ step 100/100") == 1
    assert active.history["eval/acc"] == [(100, 0.9)]


def test_a_last_evaluation_that_never_arrives_is_shown_from_the_final_report(active, capsys):
    active.begin(100, {}, [])
    active.event({"kind": "eval", "step": 50, "metrics": {"eval/acc": 0.5, "eval/loss": 2.0}})
    final = {"eval/acc": 0.75, "eval/loss": 1.0, "test/acc": 0.7, "step": 100, "epoch": 1, "final": 1}
    active.settle(100, final, timeout_s=0.2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["[xmodal]", "eval", "@", "step", "100/100", "acc", "loss"]  # no baselines
    assert lines[-1].split() == ["value", "0.7500", "1.0000"]  # the evaluation's keys, not the test split's
    assert active.history["eval/acc"] == [(50, 0.5), (100, 0.75)]
    active.settle(100, final, timeout_s=0.2)  # shown once
    assert capsys.readouterr().out == ""


def test_a_rerun_with_one_evaluation_shows_it_from_the_final_report(active, capsys):
    active.begin(100, {}, [])
    active.settle(100, {"eval/acc": 0.75, "test/acc": 0.7, "cost/params": 5.0, "step": 100, "final": 1},
                  timeout_s=0.1)
    head, value = capsys.readouterr().out.splitlines()
    assert head.split()[-1] == "acc" and value.split() == ["value", "0.7500"]


def test_ray_lines_become_events_messages_or_pass_through(active, capsys):
    active.begin(10, {}, [])
    forwarded = []
    lines = [EVENT + json.dumps({"kind": "eval", "step": 5, "epoch": 0, "metrics": {"eval/acc": 0.75}}),
             "[xmodal] resumed from checkpoint at step 4 (epoch 0)",
             "[2026 E core_worker.cc:2465] Actor with class name: 'PreemptionWatcher' and ID: 'e3' has constructor "
             "arguments in the object store and max_restarts > 0. If the arguments ...",
             "UserWarning: something a user can act on"]
    active.ray_lines({"lines": lines, "pid": 12, "actor_name": "RayTrainWorker"}, forwarded.append)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[xmodal] eval @ step 5/10") and out[1].split() == ["value", "0.7500"]
    assert out[2] == "[xmodal] resumed from checkpoint at step 4 (epoch 0)"  # no Ray prefix
    assert [d["lines"] for d in forwarded] == [["UserWarning: something a user can act on"]]
    assert active.history == {"eval/acc": [(5, 0.75)]}

    active.ray_lines({"lines": ["Traceback (most recent call last):"], "actor_name": "PlacementGroupCleaner"},
                     forwarded.append)
    assert len(forwarded) == 1
    # a known-harmless failure's traceback goes with it, over several batches; the next line comes out
    for batch in (["Failed to stop PlacementGroupCleaner gracefully.", "Traceback (most recent call last):"],
                  ['  File "x.py", line 1, in get', "ray.exceptions.GetTimeoutError: Get timed out"],
                  ["Worker group finished"]):
        active.ray_lines({"lines": batch, "pid": 7, "actor_name": "TrainController"}, forwarded.append)
    assert forwarded[-1]["lines"] == ["Worker group finished"] and len(forwarded) == 2
    # Ray Train's resource request that timed out on a loaded machine, as its controller logs it
    for batch in (["Failed to send resource request for train-e3. If this only happens transiently during network "
                   "partition or CPU being overloaded, it's safe to ignore this error.",
                   "Traceback (most recent call last):", '  File "autoscaling_coordinator_client.py", line 58'],
                  ["ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready."],
                  ["[xmodal] step 5/200"]):
        active.ray_lines({"lines": batch, "pid": 8, "actor_name": "TrainController"}, forwarded.append)
    assert len(forwarded) == 2  # the step line is the console's own: logged, not forwarded
    console.set_verbose(True)
    active.ray_lines({"lines": lines[2:3], "actor_name": "TrainController"}, forwarded.append)
    assert forwarded[-1]["lines"] == lines[2:3]  # --verbose: Ray's lines as Ray prints them


def test_worker_lines_without_a_console_are_printed(capfd):
    console.say("[xmodal] a worker's message")
    console.emit("progress", step=3, loss=0.5)
    out = capfd.readouterr().out.splitlines()
    assert out[0] == "[xmodal] a worker's message"
    assert out[1].startswith(EVENT) and json.loads(out[1][len(EVENT):]) == {"kind": "progress", "step": 3,
                                                                            "loss": 0.5}


def test_say_shows_the_text_as_given_on_a_driver_and_through_an_active_console(capsys, active):
    active.active = False
    console.say("plain table row")
    console.say("[xmodal] note: a note")
    console.say("a failure", err=True)
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["plain table row", "[xmodal] note: a note"]
    assert captured.err == "a failure\n"
    active.active = True
    console.say("plain table row")
    console.say("[xmodal] note: a note")
    assert capsys.readouterr().out.splitlines() == ["plain table row", "[xmodal] note: a note"]


# Only the command-line edge prints itself; every other line for the user goes through `console.say`.
PRINT_ALLOWED = {"base/commands.py", "base/console.py"}


def _bare_prints(path) -> list[int]:
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "print"]


def test_no_bare_print_outside_the_command_line_edge(tmp_path):
    from xmodal_testing import REPO

    package = REPO / "platform" / "xmodal"
    found = {str(p.relative_to(package)): lines for p in sorted(package.rglob("*.py"))
             if str(p.relative_to(package)) not in PRINT_ALLOWED and (lines := _bare_prints(p))}
    assert found == {}, f"bare print() calls (use xmodal.base.console.say): {found}"
    # the check itself: a call is found, a print in a string or a comment is not
    probe = tmp_path / "probe.py"
    probe.write_text('# print("no")\ns = "print(1)"\nif s:\n    print(s)\n')
    assert _bare_prints(probe) == [4]


def test_driver_noise_drops_ray_cpp_lines_on_descriptor_2(capfd, monkeypatch):
    """What Ray's C++ core worker writes to descriptor 2 in the driver: its restart note dropped, every
    other line kept in order; with --verbose nothing is dropped."""
    import os

    from xmodal.base import console as c

    noise = ("[2026 E 1 1] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches(DetectorActor))' "
             "has constructor arguments in the object store and max_restarts > 0. If the arguments ...\n")
    monkeypatch.setenv(c.VERBOSE_ENV, "0")
    with c.DriverNoise():
        os.write(2, b"before\n" + noise.encode() + b"after")
        os.write(2, b" the rest\n")
        os.write(2, b"\rbar  50%")  # a progress bar's update (no line end): copied at once, noise around it dropped
        os.write(2, noise[:30].encode())  # a noise line that comes in two writes
        os.write(2, noise[30:].encode())
        os.write(2, b"\rbar 100%\n[a line of its own]\n")
    assert capfd.readouterr().err == "before\nafter the rest\n\rbar  50%\rbar 100%\n[a line of its own]\n"
    monkeypatch.setenv(c.VERBOSE_ENV, "1")
    with c.DriverNoise():
        os.write(2, noise.encode())
    assert capfd.readouterr().err == noise


def test_progress_bar_of_driver_jobs(capsys):
    from xmodal.base.console import progress_bar

    bar = progress_bar(3, "decode TSV", "img", False)  # --no-progress: takes the calls, draws nothing
    bar.update(3)
    bar.close()
    assert capsys.readouterr() == ("", "")
    bar = progress_bar(2048, "scan TSV", "B", True)
    bar.update(2048)
    bar.close()
    err = capsys.readouterr().err
    assert "scan TSV: 100%" in err and "2.05k/2.05k" in err  # bytes scaled

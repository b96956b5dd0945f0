"""Every job's `--help` (and each subcommand's) prints its usage and exits 0.

A `%` in a help string is a format error that only `--help` reaches, so each one is run.
"""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py"))


def run_help(job: str, argv: list[str], capsys) -> str:
    spec = importlib.util.spec_from_file_location(f"_help_job_{job}", REPO / "jobs" / f"{job}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code in (0, None), f"jobs/{job}.py {' '.join(argv)} --help exited {exit_info.value.code}"
    return capsys.readouterr().out


@pytest.mark.parametrize("job", JOBS)
def test_help_of_every_job_and_subcommand(job, capsys):
    out = run_help(job, [], capsys)
    assert "usage:" in out, out
    # Subcommands appear as {a,b,c} in the usage line.
    choices = re.search(r"\{([\w,-]+)\}", out)
    for sub in choices.group(1).split(",") if choices else []:
        sub_out = run_help(job, [sub], capsys)
        assert "usage:" in sub_out and sub in sub_out, sub_out

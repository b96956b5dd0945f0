"""Ablation report from MLflow: comparison table (Markdown + CSV) and plots (PNG).

    python jobs/report.py (--experiment NAME | --parent-run RUN_ID) [--out DIR] [--metric KEY [--mode max|min]]
        [--baseline KEY=VALUE ...] [--tracking-uri URI] [--no-log]

One row per configuration (runs that differ only in their seed are grouped: mean ± std, 95 % t
interval), each tested against the baseline row (paired t-test over the seeds where both ran the same
seeds, else Welch's; Holm-adjusted over the rows), with the runs' cost beside the scores, a plot of
score against cost (Pareto front) and, for a sweep, its parameters' fANOVA importance. The files go to --out
(default reports/NAME: a new or empty folder, or this command's own earlier report, which is replaced) and
are logged to the sweep's parent run.
"""

import argparse
import sys

from xmodal.base.commands import user_errors
from xmodal.report import make_report, parse_value


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--experiment", help="every sweep in this MLflow experiment (e.g. xmodal-sweep-lxmert_tasks)")
    which.add_argument("--parent-run", help="one sweep: its MLflow parent run id")
    p.add_argument("--out", help="output folder (default reports/NAME)")
    p.add_argument("--metric", help="sort and plot by this metric (default: the sweep's)")
    p.add_argument("--mode", choices=("max", "min"),
                   help="whether higher (max) or lower (min) --metric is better: required with a --metric other "
                        "than the sweep's (the sweep's mode is its own metric's)")
    p.add_argument("--baseline", nargs="+", metavar="KEY=VALUE",
                   help="the configuration rows are tested against (default: the space's baseline, else its "
                        "first try_first)")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--no-log", action="store_true", help="do not log the files to the parent run")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that holds other files (they stay; an earlier report's files are replaced)")
    args = p.parse_args(argv)

    for flag in ("experiment", "parent_run", "metric", "out"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: expected a non-empty value")
    baseline = None
    if args.baseline:
        bad = [b for b in args.baseline if "=" not in b]
        if bad:
            p.error(f"--baseline {bad[0]!r}: expected KEY=VALUE (an ablation parameter and its value)")
        pairs = [b.split("=", 1) for b in args.baseline]
        twice = [k for i, (k, _) in enumerate(pairs) if k in [q for q, _ in pairs[:i]]]
        if twice:
            p.error(f"--baseline: {twice[0]!r} is given twice; the baseline is one configuration, one value a key")
        baseline = {k: parse_value(v) for k, v in pairs}

    def go() -> None:
        from xmodal import tracking
        from xmodal.report.build import report_output

        # before MLflow is opened: the default folder is checked once the sweep's name is known
        out = report_output(args.out, args.overwrite) if args.out is not None else None
        uri = tracking.resolve_tracking_uri(args.tracking_uri, "--tracking-uri")
        rep = make_report(uri, experiment=args.experiment, parent_run_id=args.parent_run, out_dir=out,
                          metric=args.metric, log=not args.no_log, baseline=baseline, overwrite=args.overwrite,
                          mode=args.mode)
        print(rep.markdown)
        print(f"[xmodal] report written to {rep.out_dir}")

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

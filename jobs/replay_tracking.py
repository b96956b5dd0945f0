"""Send what a run could not log to MLflow (its tracking server was unreachable) from the spool file.

    python jobs/replay_tracking.py FILE [--tracking-uri URI]

FILE is the `mlflow_unlogged.jsonl` the run named when it ended (by default under
`<scale.storage_path>/<run name>/`). The whole file is checked before anything is sent. Metric values
the run already has are skipped, so a replay that stopped halfway can be run again. The file is renamed
to `FILE.replayed` once everything in it is logged; a `*.replayed` file is refused (replayed already).
"""

import argparse
import sys

from xmodal.base.commands import user_errors


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the spool file (mlflow_unlogged.jsonl)")
    p.add_argument("--tracking-uri", help="MLflow URI to replay into (default: the one each record names)")
    args = p.parse_args(argv)

    def go() -> None:
        from xmodal import tracking

        s = tracking.replay(args.file, args.tracking_uri)
        print(f"[xmodal] replayed into run(s) {', '.join(s.runs)}: {s.metrics_logged} metric values logged, "
              f"{s.metrics_skipped} already there, {s.artifacts} artifacts, {s.tags} tag record(s), "
              f"{s.terminated} status(es); file renamed to {s.path}")

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

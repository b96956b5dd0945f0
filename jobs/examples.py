"""Example pages of a fine-tuning run (or a pretraining run's QA head): see why a model fails (docs/tracking.md).

    python jobs/examples.py --run-id RUN [--split valid] [--examples 48] [--compare RUN2] [--out DIR]
        [--tracking-uri URI]

The run's model (the weights it selected on validation) re-evaluates `--examples` examples of `--split`
of its own fine-tuning set; OUT (default examples/<run name>) gets index.html (accuracy by question and
answer type, the most frequent confusions, the examples wrong and right), one page per example (the
picture with its boxes named by the detector's vocabularies, the question, the gold answers, the top 5
predictions, the cross-attention of each word over the boxes per layer and head) and the pictures as
PNG files. A MulT run (sentiment): per clip the prediction against the label and each crossmodal
transformer's attention over time as heat maps, per layer; the index counts errors by label bin.
`--compare RUN2`: the same examples for a second run of the same task, side by side,
disagreements first, with McNemar's test. OUT must be new or empty; nothing is written on an error.
"""

import argparse
import sys

from xmodal.base.commands import setup_console, user_errors


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-id", required=True, help="MLflow run id of a finished fine-tuning (or pretraining) run")
    p.add_argument("--split", help="a split the run evaluated (default valid; a pretraining run's QA head: minival; "
                   "a MulT run: test)")
    p.add_argument("--examples", type=int, default=48, help="how many examples (default 48)")
    p.add_argument("--compare", metavar="RUN2", help="a second run of the same task: the same examples side by side")
    p.add_argument("--out", help="output folder (default examples/<run name>; new or empty)")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = p.parse_args(argv)
    setup_console(False)

    def go() -> None:
        from xmodal import tracking
        from xmodal.examples import make_examples

        uri = tracking.resolve_tracking_uri(args.tracking_uri)
        built = make_examples(uri, args.run_id, args.split, args.examples, args.compare, args.out)
        shown = built.mult if built.mult is not None else built.a.examples
        right = sum(e.right for e in shown)
        what = "clips" if built.mult is not None else "examples"
        print(f"[xmodal] {len(shown)} {built.a.split} {what} of run {built.a.run_name} ({right} right): "
              f"{built.out / 'index.html'}")

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

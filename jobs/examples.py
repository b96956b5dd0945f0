"""Example pages of a finished run: see why a model fails (docs/tracking.md).

    python jobs/examples.py --run-id RUN [--split SPLIT] [--examples 48] [--compare RUN2] [--out DIR]
        [--overwrite] [--log] [--tracking-uri URI]

A fine-tuning run (VQA, GQA, NLVR2), a pretraining run's QA head (on its store's minival) or a MulT run:
its model (the weights it selected on validation) re-evaluates `--examples` examples of `--split`, a
fixed-seed sample so every run of the same set shows the same ones. OUT (default examples/<run name>)
gets index.html, the whole viewer: the summary (accuracy by question and answer type, confusions; MulT:
errors by label bin), the examples filtered by type and right or wrong, sorted by confidence, loss or
attention entropy, and the one selected drawn in place (the picture with its boxes, the answers, the
cross-attention of each word over the boxes per layer and head; MulT: attention over time); beside it
pictures/NNNN-<right|wrong>-<type>.png, one per example.

`--compare RUN2`: the same examples for a second run of the same task, side by side: those only one
run gets right apart, the 2x2 table and McNemar's test on the console and the page, and the page logged
into RUN2 (its examples/vs-<run>/ and a line of its description). OUT must be new, empty or this
command's own earlier output (replaced); `--overwrite` writes beside other files there, removing none.
`--log`: the pages into the run too (its examples/, MLflow's table of them, a line of its description), as
a run's end logs them: for a run that logged none (`examples.count=0`; a run that has pages is refused).
Nothing is written on an error.
"""

import argparse
import sys

from xmodal.base.commands import setup_console, user_errors


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-id", required=True, help="MLflow run id of a finished fine-tuning, pretraining or MulT run")
    p.add_argument("--split", help="a split the run evaluated (default: fine-tuning valid; pretraining minival; "
                   "MulT test)")
    p.add_argument("--examples", type=int, default=48, help="how many examples, 1 to 1000 (default 48)")
    p.add_argument("--compare", metavar="RUN2", help="a second run of the same task: the same examples side by side")
    p.add_argument("--out", help="output folder (default examples/<run name>; new, empty or this command's own)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that holds other files (they are kept)")
    p.add_argument("--log", action="store_true",
                   help="log the pages into the run too, as a run's end does (a run that has none)")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = p.parse_args(argv)
    setup_console(False)

    def go() -> None:
        from xmodal import tracking
        from xmodal.examples import make_examples

        uri = tracking.resolve_tracking_uri(args.tracking_uri, "--tracking-uri")
        built = make_examples(uri, args.run_id, args.split, args.examples, args.compare, args.out, args.overwrite,
                              args.log)
        print(f"[xmodal] {built.line}")
        c = built.comparison
        if c is not None:
            print(f"                 B right  B wrong\n  A right  {c.both_right:>9} {c.only_a:>8}\n"
                  f"  A wrong  {c.only_b:>9} {c.both_wrong:>8}\n"
                  f"  McNemar's test ({c.test}, {c.only_a + c.only_b} disagreements): p = {c.p_value:.4g}")
        print(f"  pages       {built.out / 'index.html'}")
        if built.logged:
            print(f"  in MLflow   {built.logged} (run {'B' if c is not None else args.run_id})")

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

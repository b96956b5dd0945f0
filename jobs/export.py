"""Export a trained model for use outside xmodal (docs/export.md).

    python jobs/export.py --to transformers|reference|mult-reference --out DIR
        (--run-id ID | --checkpoint DIR | --logged-model URI) [--tracking-uri URI] [--overwrite]

Sources: an MLflow run's final checkpoint (--run-id, in --tracking-uri, default $MLFLOW_TRACKING_URI,
else ./mlflow.db), a checkpoint folder (--checkpoint), or a run's logged MLflow model (--logged-model
models:/ID or runs:/RUN_ID/final_model). Targets: `transformers` (a from_pretrained directory:
LxmertForPreTraining, LxmertForQuestionAnswering; NLVR2: LxmertModel + its classifier file),
`reference` (the LXMERT reference code's model_LXRT.pth / BEST.pth), `mult-reference` (MulT as the
reference MULTModel's state dict + hyp_params.json). The weights are the run's model: those selected on
validation for fine-tuning and MulT, the last for pretraining (the output says which); weight files that
no longer match the sha256 their checkpoint recorded are refused. What a target cannot hold is refused
before anything is written; DIR is checked first (new, empty, or this command's own earlier export, which
is replaced; --overwrite writes into a folder holding other files or folders and keeps them; a link, or
`..`, is followed to the folder it names, and written there under the same rules), written whole or not
at all.
"""

import argparse
import sys

from xmodal.base.commands import setup_console, user_errors


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", required=True, choices=["transformers", "reference", "mult-reference"], help="target format")
    p.add_argument("--out", required=True, help="output folder (new or empty, or an earlier export of this command)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-id", help="MLflow run id: its final checkpoint (the `model` artifact; the selected weights "
                       "where the run selects on validation)")
    which.add_argument("--checkpoint", help="checkpoint folder (model.pt + meta.json), e.g. runs/NAME/checkpoint_...")
    which.add_argument("--logged-model", help="a run's logged model: models:/MODEL_ID or runs:/RUN_ID/final_model")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that holds other files (they stay; an earlier export's files are replaced)")
    args = p.parse_args(argv)
    setup_console(False)

    def go() -> None:
        from xmodal.export import run_export

        run_export(args.to, args.out, run_id=args.run_id, checkpoint=args.checkpoint, logged_model=args.logged_model,
                   tracking_uri=args.tracking_uri, overwrite=args.overwrite)

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

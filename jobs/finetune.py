"""LXMERT fine-tuning on Ray Train: VQA, GQA or NLVR2. With no arguments: the embedded default (local
Ray, a synthetic VQA-style set built on first use from the embedded synthetic image store, starting
from the newest finished pretraining run on that store, else from scratch; MLflow in ./mlflow.db).

    python jobs/finetune.py [--task vqa|gqa|nlvr2] [--init latest|scratch|run|checkpoint|transformers|reference]
        [--init-run-id ID] [--init-path DIR|FILE] [--store SET_DIR] [--config FILE.yaml] [--set key=value ...]
        [--num-workers N] [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME]

Model selection on the validation split; every held-out split is then predicted once with the
selected model, and the prediction files (reference submission formats) are logged to the run.
"""

import sys

from xmodal.cli.training import job_main


def main(argv: list[str]) -> int:
    return job_main(argv, job="finetune", doc=__doc__,
                    extra={"task": ("task", "{}", "vqa, gqa or nlvr2"),
                           "store": ("data.store", "{}", "fine-tuning set directory (jobs/ingest.py vqa|gqa|nlvr2)"),
                           "init": ("init.source", "{}", "where the weights come from"),
                           "init_run_id": ("init.run_id", "{}", "MLflow run id of a pretraining run"),
                           "init_path": ("init.path", "{}", "checkpoint folder, transformers directory or reference snapshot file")})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The spread behind the learning tests' bars: the embedded default pretrained (and fine-tuned from
pretrained and from scratch) in-process, once per seed and thread count, exactly as
tests/jobs/test_learning.py runs it.

    python scripts/learning_spread.py [--seeds 0,1,2,3,4] [--threads 1,2] [--out spread.jsonl]

One JSON line per run: seed, threads, wall seconds, minival metrics, priors, fine-tuned accuracies.

    python scripts/learning_spread.py --ablation search_spaces/lxmert_tasks.yaml [--seeds 0,1,2]

instead runs the space's pretraining-task subsets (all, no_vision, no_qa) at the space's own budget
(its `base.config` and `base.set`), each pretrained and then fine-tuned from, in-process, and prints
the downstream synthetic VQA accuracy per subset and seed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from xmodal.config.experiment import load_config
from xmodal.data.finetune.synthetic import build_synthetic_vqa
from xmodal.data.lxmert.priors import pretraining_priors
from xmodal.data.lxmert.synthetic import build_synthetic_store
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.jobs.finetune_job import Init, finetune_in_process
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.jobs.pretrain_job import pretrain_in_process, with_store_dims


def one_run(seed: int, threads: int, tmp: Path, finetune: bool) -> dict:
    torch.set_num_threads(threads)
    cfg = load_config(PretrainConfig, overrides=[f"train.seed={seed}"])
    tmp.mkdir(parents=True)
    store = build_synthetic_store(tmp / "store", cfg.data.synthetic)
    t0 = time.perf_counter()
    objective, metrics = pretrain_in_process(cfg, store)
    row = {"seed": seed, "threads": threads, "pretrain_s": round(time.perf_counter() - t0, 1),
           "minival": metrics, "priors": pretraining_priors(store, cfg.data.masking.mismatch_prob)}
    if finetune:
        folder = tmp / "model"
        folder.mkdir()
        torch.save(objective.state_dict(), folder / "model.pt")
        fcfg = load_config(FinetuneConfig, overrides=[f"train.seed={seed}"])
        data = build_synthetic_vqa(store.path, tmp / "vqa", questions_per_image=fcfg.data.synthetic_questions_per_image)
        arch = with_store_dims(cfg, store).model
        t0 = time.perf_counter()
        row["finetune"] = {
            "pretrained": finetune_in_process(fcfg, data, Init("checkpoint", path=str(folder),
                                              pretrain_answers=list(store.answers().answers)), arch),
            "scratch": finetune_in_process(fcfg, data, Init("scratch")),
        }
        row["finetune_s"] = round(time.perf_counter() - t0, 1)
    return row


ABLATION = {  # search_spaces/lxmert_tasks.yaml's options
    "all": [],
    "no_vision": ["tasks.obj_feat=false", "tasks.obj_label=false"],
    "no_qa": ["tasks.qa=false"],
}


def ablation_run(space_file: str, subset: str, seed: int, tmp: Path) -> dict:
    from xmodal.config.experiment import apply_overrides, load_yaml

    space = load_yaml(Path(space_file).read_text())
    chain = apply_overrides(space["base"].get("config", {}), space["base"].get("set", []))
    pcfg = load_config(PretrainConfig, base=chain.get("pretrain", {}), overrides=ABLATION[subset] + [f"train.seed={seed}"])
    fcfg = load_config(FinetuneConfig, base=chain.get("finetune", {}), overrides=[f"train.seed={seed}"])
    tmp.mkdir(parents=True)
    store = build_synthetic_store(tmp / "store", pcfg.data.synthetic)
    objective, metrics = pretrain_in_process(pcfg, store)
    (tmp / "model").mkdir()
    torch.save(objective.state_dict(), tmp / "model" / "model.pt")
    data = build_synthetic_vqa(store.path, tmp / "vqa", questions_per_image=fcfg.data.synthetic_questions_per_image)
    init = Init("checkpoint", path=str(tmp / "model"), pretrain_answers=list(store.answers().answers))
    down = finetune_in_process(fcfg, data, init, with_store_dims(pcfg, store).model)
    return {"subset": subset, "seed": seed, "pretrain_minival": metrics, "valid/accuracy": down["valid/accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--no-finetune", action="store_true")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--ablation", default=None, help="a pretrain_finetune space file (lxmert_tasks.yaml)")
    p.add_argument("--subsets", default=",".join(ABLATION), help="with --ablation: which subsets")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.ablation:
            torch.set_num_threads(int(a.threads.split(",")[0]))
            for seed in (int(x) for x in a.seeds.split(",")):
                for subset in a.subsets.split(","):
                    row = ablation_run(a.ablation, subset, seed, Path(tmp) / f"{subset}-{seed}")
                    _emit(row, a.out)
            return
        for threads in (int(x) for x in a.threads.split(",")):
            for seed in (int(x) for x in a.seeds.split(",")):
                _emit(one_run(seed, threads, Path(tmp) / f"{seed}-{threads}", not a.no_finetune), a.out)


def _emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()

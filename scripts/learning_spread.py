"""The spread behind the learning tests' bars: the embedded default pretrained (and fine-tuned from
pretrained and from scratch) in-process, once per seed and thread count, exactly as
tests/jobs/test_learning.py runs it.

    python scripts/learning_spread.py [--seeds 0,1,2,3,4] [--threads 1,2] [--out spread.jsonl [--overwrite]]

One JSON line per run: seed, threads, wall seconds, minival metrics, priors, fine-tuned accuracies.

    python scripts/learning_spread.py --ablation search_spaces/lxmert_tasks.yaml [--seeds 0,1,2]

instead runs the space's pretraining-task subsets (all, no_vision, no_qa) at the space's own budget
(its `base.config` and `base.set`), each pretrained and then fine-tuned from, in-process, and prints
the downstream synthetic VQA accuracy per subset and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from xmodal.base.commands import user_errors
from xmodal.base.errors import UserError
from xmodal.base.outputs import Output
from xmodal.config.experiment import load_config
from xmodal.data.finetune.synthetic import build_synthetic_vqa
from xmodal.data.lxmert.priors import pretraining_priors
from xmodal.data.lxmert.synthetic import build_synthetic_store
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.jobs.finetune_init import Init
from xmodal.jobs.finetune_job import finetune_in_process
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


def ablation_base(space_file: str) -> dict:
    """The chain's base config of a pretrain_finetune space (checked as a sweep checks it)."""
    from xmodal.sweep.space import base_config, load_space

    space = load_space(space_file)
    if space.job != "pretrain_finetune":
        raise UserError(f"--ablation {space_file}: a space of job {space.job!r}; expected a pretrain_finetune space")
    return base_config(space, space_file)


def ablation_run(chain: dict, subset: str, seed: int, tmp: Path) -> dict:
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


def _numbers(flag: str, text: str, low: int) -> list[int]:
    """A comma-separated list of integers >= low, or UserError naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not values or min(values) < low:
        raise UserError(f"{flag} {text!r}: expected integers >= {low}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--no-finetune", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file (a new file), at the end")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE")
    p.add_argument("--ablation", default=None, help="a pretrain_finetune space file (lxmert_tasks.yaml)")
    p.add_argument("--subsets", default=",".join(ABLATION), help="with --ablation: which subsets")
    a = p.parse_args(argv)

    def go() -> None:
        seeds, threads = _numbers("--seeds", a.seeds, 0), _numbers("--threads", a.threads, 1)
        subsets = [x for x in a.subsets.split(",") if x]
        unknown = [x for x in subsets if x not in ABLATION]
        if unknown or not subsets:
            raise UserError(f"--subsets {a.subsets!r}: expected some of {', '.join(ABLATION)}")
        out = Output(a.out, "--out", "learning_spread", file=True, overwrite=a.overwrite) if a.out else None
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            if a.ablation:
                torch.set_num_threads(threads[0])
                chain = ablation_base(a.ablation)
                runs = [(lambda s=s, sub=sub: ablation_run(chain, sub, s, Path(tmp) / f"{sub}-{s}"))
                        for s in seeds for sub in subsets]
            else:
                runs = [(lambda s=s, t=t: one_run(s, t, Path(tmp) / f"{s}-{t}", not a.no_finetune))
                        for t in threads for s in seeds]
            for run in runs:
                rows.append(json.dumps(run()))
                print(rows[-1], flush=True)
        if out is not None:
            with out.stage() as stage:
                stage.tmp.write_text("".join(line + "\n" for line in rows))
                stage.publish()

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main())

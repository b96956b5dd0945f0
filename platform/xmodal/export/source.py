"""What an export reads: a trained model, from an MLflow run, a checkpoint folder or a logged model.

Each source gives a `Source`: the bare model (the one the run's MLflow model holds,
`runner/run_record.py: exported_model`) in fp32 eval mode with the weights the run selected (`best_model.pt`
of selecting jobs) or its last ones, what kind of model it is, and the tokenizer vocabulary of the
store it was trained on when that store has one. The run's checkpoint is found and checked as
fine-tuning's `--init run|checkpoint` finds it (`jobs/finetune_init.py: run_model_folder`,
`checkpoint_files`); the job and its config come from the checkpoint's meta (`jobs/registry.py: JOBS`).

A checkpoint's weight files are checked against the size and sha256 its meta records (`checkpoint.seal`)
before they are read, and a selecting job's checkpoint that lacks the selected weights its meta records
(or a finished selecting run's `model` artifact without them) is refused: exporting its last weights
instead would be a different model under the run's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import nn

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.errors import UserError
from xmodal.base.outputs import check_local_input
from xmodal.core import checkpoint as ckpt
from xmodal.jobs.finetune_init import checkpoint_files, run_model_folder
from xmodal.runner.hooks import ValidationSelection
from xmodal.runner.run_record import final_weights

# Our model kinds: the pretraining model, the three fine-tuning tasks, MulT.
KINDS = ("pretrain", "vqa", "gqa", "nlvr2", "mult")
VOCAB_FILE = "vocab.txt"  # data/tokenizer.py: every LXMERT store holds its vocabulary under this name
BEST_FILE = ValidationSelection.BEST_FILE
WEIGHT_FILES = (ckpt.MODEL_FILE, BEST_FILE)  # what an export may read of a checkpoint, checked before


class SourceError(UserError):
    """The source named cannot be read as a model of ours; the message names the option and the file."""


@dataclass
class Source:
    kind: str  # one of KINDS
    model: nn.Module  # fp32, eval, CPU
    origin: str  # what was read, for messages and the provenance file
    weights: str  # "selected" (on validation), "last", "as given", or "logged model" (a logged model saying neither)
    run_id: str | None = None
    vocab: Path | None = None  # the store's vocab.txt, when it has one
    config: dict[str, Any] | None = None  # the run's resolved config
    selected_on: str | None = None  # the validation metric the weights were selected on (weights "selected")
    notes: list[str] = field(default_factory=list)  # what the export's reader should know of these weights

    def describe_weights(self) -> str:
        """The weights in words, for the output line."""
        if self.weights == "selected":
            return f"weights selected on {self.selected_on}" if self.selected_on else "weights selected on validation"
        return f"{self.weights} weights"


def from_model(model: nn.Module, kind: str, origin: str = "a model in memory", vocab: Path | None = None) -> Source:
    """A model built in this process (library use, tests)."""
    if kind not in KINDS:
        raise SourceError(f"kind {kind!r}; expected one of {', '.join(KINDS)}")
    return Source(kind, model.float().eval(), origin, "as given", vocab=vocab)


def from_checkpoint(path: str | Path, key: str = "--checkpoint", run_id: str | None = None) -> Source:
    """A checkpoint folder (`core/checkpoint.py`: model.pt, meta.json; `best_model.pt` when the job
    selects on validation) or, with `run_id`, the downloaded `model` artifact folder of that run (its
    final checkpoint: a selecting job's must hold the selected weights)."""
    if not str(path).strip():  # resolved, '' would be the working folder, and the error would name that
        raise SourceError(f"{key}: {str(path)!r} is empty; expected a checkpoint folder (model.pt + meta.json)")
    check_local_input(str(path), key, "a checkpoint folder on this machine; a run's model in MLflow is --run-id or "
                      "--logged-model")
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise SourceError(f"{key}: {str(p)!r} does not exist")
    if p.is_file() and p.name != ckpt.MODEL_FILE:  # a checkpoint's own model.pt names its folder
        raise SourceError(f"{key}: {str(p)!r} is a file; expected a checkpoint folder (model.pt + meta.json), "
                          "e.g. runs/NAME/checkpoint_...")
    folder = checkpoint_files(p, key)
    meta_file = folder / ckpt.META_FILE
    try:
        meta = ckpt.read_meta(folder)
    except (OSError, ValueError) as e:
        raise SourceError(f"{key}: {meta_file} is not readable JSON: {e}") from None
    raw = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(raw, dict):
        raise SourceError(f"{key}: {meta_file} holds no config (not an xmodal checkpoint?)")
    kind, cfg, selects = job_config(raw, f"{key}: {meta_file}")
    # What the messages call the folder: a run's artifact is downloaded into a temporary folder.
    where = f"run {run_id}'s `model` artifact" if run_id is not None else str(folder)
    recorded = check_recorded(folder, meta, key, where)
    notes = []
    if not (folder / BEST_FILE).is_file():
        if run_id is not None and selects:
            raise SourceError(
                f"{key}: {where} holds no {BEST_FILE}, the weights the run selected on validation "
                f"({cfg.train.best_metric}); runs logged before the artifact held that file lack it: export its "
                f"MLflow model (--logged-model runs:/{run_id}/final_model), which holds them, or its final "
                "checkpoint folder (--checkpoint RUNS/NAME/checkpoint_...)")
        if BEST_FILE in recorded:
            logged = f"runs:/{meta['run_id']}/final_model" if meta.get("run_id") else "runs:/RUN_ID/final_model"
            raise SourceError(
                f"{key}: {where} lacks {BEST_FILE}, the weights its run selected on validation, which "
                f"{meta_file.name} records: export the whole checkpoint folder, or the run's MLflow model "
                f"(--logged-model {logged})")
        if selects:
            notes.append("this checkpoint holds no weights selected on validation (written before the run's first "
                         "validation): these are its last weights, not the run's selected model")
    try:
        state, which = final_weights(folder)
    except Exception as e:  # torch's own errors for a foreign or truncated file
        first = (str(e).strip().splitlines() or [""])[0][:160]  # torch's own text runs over many lines
        raise SourceError(f"{key}: the weights in {where} cannot be read ({type(e).__name__}: {first}); expected "
                          "the model.pt a run's checkpoint holds") from None
    model = bare_model(kind, cfg, state, f"{key}: {where}")
    return Source(kind, model, f"checkpoint {folder}", which, run_id=meta.get("run_id"),
                  vocab=vocab_of(meta.get("store")), config=raw,
                  selected_on=cfg.train.best_metric if which == "selected" else None, notes=notes)


def check_recorded(folder: Path, meta: dict[str, Any], key: str, where: str) -> set[str]:
    """The weight files of a checkpoint folder against the size and sha256 its meta records
    (`checkpoint.seal`); a mismatch is refused, naming the file. Returns the names the meta records (none
    for a folder written before checksums, which is read as it is)."""
    files = meta.get("files")
    if files is None:
        return set()
    if not isinstance(files, dict):
        raise SourceError(f"{key}: {where}: {ckpt.META_FILE}'s 'files' is {type(files).__name__}; expected the "
                          "name -> {bytes, sha256} table a checkpoint records")
    for name in WEIGHT_FILES:
        if name not in files or not (folder / name).is_file():
            continue
        try:
            wrong = ckpt.file_mismatch(folder, name, files[name])
        except ValueError as e:
            raise SourceError(f"{key}: {where}: {e}") from None
        if wrong:
            raise SourceError(f"{key}: {name} in {where} {wrong}; refusing to export it")
    return set(files)


def from_run(uri: str, run_id: str, download_dir: Path) -> Source:
    """An MLflow run's final checkpoint (its `model` artifact), downloaded into `download_dir`: the
    weights its MLflow model holds (selected on validation where the job selects)."""
    folder = run_model_folder(uri, run_id, Path(download_dir), key="--run-id")
    source = from_checkpoint(folder, key="--run-id", run_id=run_id)
    source.origin, source.run_id = f"run {run_id} ({uri})", run_id
    return source


def from_logged_model(uri: str, model_uri: str, download_dir: Path) -> Source:
    """A run's logged MLflow model (`models:/<id>` or `runs:/<run id>/final_model`, `tracking.log_pytorch_model`)."""
    from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
    from xmodal.models.lxmert.model import LxmertForPretraining
    from xmodal.models.mult.model import Mult

    logged = tracking.load_logged_model(uri, model_uri, download_dir)
    m, config = logged.module, logged.config or {}
    if isinstance(m, LxmertForPretraining):
        kind = "pretrain"
    elif isinstance(m, LxmertForQuestionAnswering):
        kind = config.get("task", "vqa")
    elif isinstance(m, LxmertForNlvr2):
        kind = "nlvr2"
    elif isinstance(m, Mult):
        kind = "mult"
    else:
        raise SourceError(f"--logged-model: {model_uri!r} holds a {type(m).__name__}; expected one of our models "
                          "(LxmertForPretraining, LxmertForQuestionAnswering, LxmertForNlvr2, Mult)")
    vocab = None
    if logged.run_id:
        tags = tracking.get_run(uri, logged.run_id).tags
        vocab = vocab_of(tags.get(run_tags.FINETUNE_SET) or tags.get(run_tags.STORE))
    # The run said which weights it logged (`record.log_model`'s metadata: "selected on METRIC" or "last").
    said = str(logged_metadata(logged.path).get("weights", ""))
    which, selected_on = ("selected", said[len("selected on "):] or None) if said.startswith("selected on ") \
        else ("last", None) if said == "last" else ("logged model", None)
    return Source(kind, m.float().eval(), f"logged model {model_uri} ({uri})", which,
                  run_id=logged.run_id, vocab=vocab, config=logged.config, selected_on=selected_on)


def logged_metadata(folder: Path) -> dict[str, Any]:
    """The `metadata` of a downloaded MLflow model's MLmodel file ({} when it has none)."""
    import yaml

    try:
        meta = (yaml.safe_load((Path(folder) / "MLmodel").read_text()) or {}).get("metadata")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}
    return meta if isinstance(meta, dict) else {}


def job_config(raw: dict[str, Any], where: str):
    """(kind, typed config, whether the job selects its model on validation) of a run's resolved config:
    the job whose config class accepts it."""
    from xmodal.jobs.registry import JOBS

    errors = []
    for name in ("pretrain", "finetune", "mult"):
        try:
            cfg = JOBS[name].config_class.model_validate(raw)
        except ValidationError as e:
            errors.append(f"{name}: {e.errors()[0]['loc']}")
            continue
        return ({"pretrain": "pretrain", "mult": "mult"}.get(name) or cfg.task), cfg, JOBS[name].selects_on_validation
    raise SourceError(f"{where}: its config is no pretraining, fine-tuning or MulT config ({'; '.join(errors)})")


def bare_model(kind: str, cfg, state: dict[str, Any], where: str) -> nn.Module:
    """The job's bare model (`record.exported_model`) with an objective state dict's weights."""
    from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
    from xmodal.models.lxmert.model import LxmertForPretraining
    from xmodal.models.mult.model import Mult

    prefix = "model."
    foreign = [k for k in state if not k.startswith(prefix)]
    if foreign:
        raise SourceError(f"{where}: entries outside the objective's model: {', '.join(foreign[:6])}")
    sd = {k[len(prefix):]: v for k, v in state.items()}
    if kind == "pretrain":
        model = LxmertForPretraining(cfg.model)
    elif kind in ("vqa", "gqa"):
        rows = sd.get("answer_head.fc2.weight")
        if rows is None:
            raise SourceError(f"{where}: no answer_head.fc2.weight in a {kind} checkpoint")
        model = LxmertForQuestionAnswering(cfg.model, int(rows.shape[0]))
    elif kind == "nlvr2":
        model = LxmertForNlvr2(cfg.model, output=cfg.nlvr2_output)
    else:
        model = Mult(cfg.model)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise SourceError(f"{where}: the weights do not fit the {kind} model of its config: "
                          f"{' '.join(str(e).split())[:600]}") from None
    return model.float().eval()


def vocab_of(store: str | None) -> Path | None:
    """The tokenizer vocabulary of the data a run read: an LXMERT store's own vocab.txt, or, for a
    fine-tuning set, that of the LXMERT store its manifest names (`store`: the one whose tokenizer
    made its input_ids). None for MulT stores and stores no longer there."""
    if not store:
        return None
    p = Path(store)
    if (p / VOCAB_FILE).is_file():
        return p / VOCAB_FILE
    try:
        named = json.loads((p / "manifest.json").read_text()).get("store")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(named, str) and (Path(named) / VOCAB_FILE).is_file():
        return Path(named) / VOCAB_FILE
    return None

"""Where a fine-tuning run's weights come from (`init`, `jobs/finetune_job.py`): the source resolved in
the driver (`resolve_init`: the newest finished pretraining run on the same image store, an MLflow run, a
checkpoint folder, a transformers directory or a reference snapshot) into a plain `Init` that the run
plan carries, the source run checked to be an LXMERT run whose weights are readable, and the weights
loaded into the fine-tuning model in each worker (`load_init`), the answer head from the pretraining QA
head where the answer tables overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.outputs import check_local_input
from xmodal.config.experiment import ConfigError
from xmodal.core import checkpoint as ckpt
from xmodal.jobs.finetune_config import INIT_PATH_SOURCES, FinetuneConfig
from xmodal.models.lxmert.model import LxmertConfig
from xmodal.runner.hooks import say
from xmodal.runner.ray_cluster import removed_on_failure


@dataclasses.dataclass
class Init:
    """The resolved `init`: what the workers load (plain JSON-able data in the run plan)."""

    source: str  # scratch | run | checkpoint | transformers | reference
    path: str | None = None  # folder with model.pt (+ meta.json), the transformers directory, or the reference file
    run_id: str | None = None
    pretrain_answers: list[str] | None = None  # the pretraining QA table, when its store is known
    tracking_uri: str | None = None  # source run: where a worker that cannot see `path` fetches the weights


def checkpoint_files(path: Path, key: str = "init.path") -> Path:
    """A folder holding model.pt and meta.json (given the folder or its model.pt); `key` is the option
    that named it, for the error (`xmodal.export` reads checkpoints the same way)."""
    folder = path.parent if path.is_file() else path
    missing = [f for f in (ckpt.MODEL_FILE, ckpt.META_FILE) if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{key}: {str(path)!r} is not a checkpoint: {', '.join(missing)} missing (expected "
                          "a checkpoint folder of a run, or the `model` artifact folder of its MLflow run)")
    return folder


def run_model_folder(uri: str, run_id: str, download_dir: Path, key: str = "init.run_id", lxmert: bool = False
                     ) -> Path:
    """The run's `model` artifact (its final checkpoint folder) checked (`check_init_run`; `lxmert`: the
    run must be of an LXMERT job) and downloaded into `download_dir / run_id`. A failed download or check
    leaves nothing there, nor any folder made for it."""
    check_init_run(uri, run_id, key, lxmert=lxmert)
    with removed_on_failure(download_dir / run_id) as dest:
        try:
            folder = tracking.download_artifacts(uri, run_id, "model", dest)
        except Exception as e:
            raise ConfigError(f"{key}: run {run_id!r} has no `model` artifact (did it finish?): {e}") from None
        return checkpoint_files(folder, key)


def _pretrain_answers(store_path: str | None) -> list[str] | None:
    from xmodal.data.lxmert.store import open_store

    try:
        return list(open_store(store_path).answers().answers) if store_path else None
    except (OSError, ValueError):
        return None  # the pretraining store is not readable here: the answer head starts fresh


def resolve_init(cfg: FinetuneConfig, image_store: str, uri: str, download_dir: Path) -> tuple[Init, LxmertConfig | None]:
    """Where the weights come from, and the architecture they fix (None = from scratch: cfg.model)."""
    i = cfg.init
    source, run_id = i.source, i.run_id
    if source == "latest":
        run = tracking.latest_finished_run(uri, i.pretrain_experiment, {run_tags.TASK: "pretrain", run_tags.STORE: image_store}) \
            if uri else None
        if run is None:
            say(f"[xmodal] no finished pretraining run on {image_store} in experiment {i.pretrain_experiment!r}: "
                "fine-tuning from scratch")
            return Init("scratch"), None
        source, run_id = "run", run.run_id
        say(f"[xmodal] fine-tuning from the latest pretraining run {run.name} ({run_id})")
    if source == "scratch":
        return Init("scratch"), None
    if source in INIT_PATH_SOURCES:
        return resolve_path_init(source, i.path)
    with removed_on_failure(download_dir / run_id):  # a download whose checkpoint is refused goes too
        init, model = _checkpoint_init(run_model_folder(uri, run_id, download_dir, lxmert=True),
                                       f"init.run_id: the `model` artifact of run {run_id!r}")
    return dataclasses.replace(init, source="run", run_id=run_id, tracking_uri=uri), model


def resolve_path_init(source: str, path_text: str) -> tuple[Init, LxmertConfig]:
    """init.source checkpoint, transformers or reference: the folder or file read and checked (a
    foreign or malicious file fails here, in the driver), and the architecture it fixes."""
    check_local_input(path_text, "init.path", f"init.source={source} reads a folder or file on this machine; a "
                      "run's model in MLflow is --init run --init-run-id ID")
    path = Path(path_text).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"init.path: {str(path)!r} does not exist")
    if source == "checkpoint":
        return _checkpoint_init(checkpoint_files(path))
    if source == "transformers":
        from xmodal.models.lxmert.hf import config_from_hf_dir, weights_present

        try:
            config = config_from_hf_dir(path)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise ConfigError(f"init.path: {e}") from None
        if not weights_present(path):
            raise ConfigError(f"init.path: no weights in {path}: expected model.safetensors, pytorch_model.bin or "
                              "their .index.json beside config.json")
        return Init("transformers", path=str(path)), config
    from xmodal.models.lxmert.init import PretrainedWeightsError, reference_weights

    if not path.is_file():
        raise ConfigError(f"init.path: {str(path)!r} is not a file; expected a snapshot of the reference "
                          "code: its pretrained model_LXRT.pth or a fine-tuned BEST.pth")
    try:
        weights = reference_weights(path)
    except (OSError, PretrainedWeightsError) as e:
        raise ConfigError(f"init.path: {e}") from None
    what = f"a fine-tuned snapshot ({weights.head})" if weights.head else "a pretrained snapshot"
    say(f"[xmodal] fine-tuning from the reference code's {what} {path}")
    return Init("reference", path=str(path)), weights.config


def _checkpoint_init(folder: Path, what: str | None = None) -> tuple[Init, LxmertConfig]:
    """A checkpoint folder's architecture (meta.json) and its weights file read as a state dict (memory-mapped,
    no code run), so that what a worker would refuse is refused here. `what`: the folder as the
    messages name it (a run's downloaded artifact), else `init.path: <its meta.json>`."""
    from xmodal.models.lxmert.init import PretrainedWeightsError, read_state_dict_file

    where = what or f"init.path: {folder / ckpt.META_FILE}"
    try:
        meta = ckpt.read_meta(folder)
    except (OSError, ValueError) as e:  # ValueError: JSON's decode and UTF-8 errors
        raise ConfigError(f"init.path: {folder / ckpt.META_FILE} is not readable JSON: {e}") from None
    model = meta.get("config", {}).get("model") if isinstance(meta, dict) else None
    if not isinstance(model, dict) or not model:
        raise ConfigError(f"init: {folder / ckpt.META_FILE} holds no model config (not an xmodal checkpoint?)")
    if MULT_MODEL_KEYS & set(model):  # a run or folder of jobs/train_mult.py, untagged or named by path
        raise ConfigError(f"{where} holds a MulT model's checkpoint; fine-tuning needs an LXMERT pretraining or "
                          "fine-tuning checkpoint")
    foreign = sorted(set(model) - {f.name for f in dataclasses.fields(LxmertConfig)})
    if foreign:
        raise ConfigError(f"{where}: its model config has keys an LXMERT model does not take: "
                          f"{', '.join(foreign[:8])} (not an LXMERT checkpoint, or one of another xmodal version)")
    try:
        config = LxmertConfig(**model)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: its model config is not valid: {e}") from None
    try:
        read_state_dict_file(folder / ckpt.MODEL_FILE)
    except PretrainedWeightsError as e:
        raise ConfigError(f"init.path: {e}") from None
    return Init("checkpoint", path=str(folder), pretrain_answers=_pretrain_answers(meta.get("store"))), config


def check_init_run(uri: str, run_id: str, key: str = "init.run_id", lxmert: bool = False) -> None:
    """The run of init.source=run exists in the tracking store and has a `model` artifact; with `lxmert`,
    it is not the run of another model (`run_model`: its tags say). Reads only: a SQLite database or file
    store that does not exist is not created (it holds no runs). `key`: the option that named the run,
    for the errors."""
    local = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else \
        uri[len("file://"):] if uri.startswith("file://") else None
    if local is not None and not Path(local).exists():
        raise ConfigError(f"{key}: no MLflow run {run_id!r}: there is no MLflow store at {local} "
                          "(mlflow.tracking_uri)")
    if uri.startswith(("http://", "https://")) and not tracking.reachable(uri):
        raise ConfigError(f"{key}: cannot look up run {run_id!r}: the tracking server {uri} does not answer "
                          "(mlflow.tracking_uri)")
    try:
        run = tracking.get_run(uri, run_id)
    except tracking.RunNotFound:
        raise ConfigError(f"{key}: no MLflow run {run_id!r} at {uri}") from None
    if lxmert:
        _check_lxmert_run(run, key)
    try:
        listed = tracking.list_artifacts(uri, run_id, "model")
    except Exception as e:  # the artifact store's own errors (a missing folder, a refused bucket)
        raise ConfigError(f"{key}: the artifacts of run {run_id!r} cannot be read: {e}") from None
    names = {Path(a).name for a in listed}
    missing = [f for f in (ckpt.MODEL_FILE, ckpt.META_FILE) if f not in names]
    if missing:
        raise ConfigError(f"{key}: run {run_id!r} has no `model` artifact with {', '.join(missing)} (did it "
                          "finish? a pretraining run logs it at its end)")


MODEL_NAMES = {"lxmert": "an LXMERT", "mult": "a MulT"}  # run_tags.MODEL's values, in words


MULT_MODEL_KEYS = {"variant", "l_dim", "a_dim", "v_dim"}  # keys of MulT's model config that LXMERT's lacks


def run_model(run: tracking.RunRecord) -> str | None:
    """The model family a run trained, as its tags say (run_tags.MODEL: lxmert or mult; a multi-seed
    parent has only the job's name in run_tags.TASK), or None when they do not say."""
    return run.tags.get(run_tags.MODEL) or {"mult": "mult", "pretrain": "lxmert"}.get(run.tags.get(run_tags.TASK, ""))


def _check_lxmert_run(run: tracking.RunRecord, key: str) -> None:
    """The run given to fine-tuning's `--init run` is not known to be another model's (MulT's) run or a
    sweep's parent run, which hold no LXMERT weights: said in the user's terms, before any download."""
    model = run_model(run)
    if model is not None and model != "lxmert":
        source = run.tags.get(run_tags.SOURCE_NAME, "")
        job = f" (job {Path(source).stem})" if source.startswith("jobs/") else ""
        raise ConfigError(f"{key}: run {run.run_id!r} is {MODEL_NAMES.get(model, f'a {model!r}')} run{job}; "
                          "--init run needs an LXMERT pretraining or fine-tuning run")
    if run.tags.get(run_tags.KIND) == "sweep":
        raise ConfigError(f"{key}: run {run.run_id!r} is a sweep's parent run, which holds no model; give the run "
                          "id of one of its trials (the MLflow UI lists them under it)")


@contextlib.contextmanager
def run_weights_here(init: Init) -> Iterator[Path]:
    """The folder of the starting weights as this process sees it. A source run's weights were
    downloaded by the driver into the run's storage (`<storage>/<run>/init`); a worker on a host that
    does not see that folder (the storage is not shared, or is an object store, so the driver's copy
    was a scratch folder) downloads the run's `model` artifact itself into a scratch folder, removed
    after. Either copy is checked against the sha256 the run recorded for its model file."""
    folder = Path(init.path)
    if init.source != "run":
        yield folder
        return
    if (folder / ckpt.MODEL_FILE).is_file():
        _check_weights(folder, init)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="xmodal-init-") as scratch:
        got = tracking.download_artifacts(init.tracking_uri, init.run_id, "model", scratch)
        _check_weights(got, init)
        yield got


def _check_weights(folder: Path, init: Init) -> None:
    try:
        record = ckpt.read_meta(folder).get("files", {}).get(ckpt.MODEL_FILE)
        wrong = ckpt.file_mismatch(folder, ckpt.MODEL_FILE, record) if record is not None else None
    except (OSError, ValueError) as e:
        wrong = f"cannot be checked ({e})"
    if wrong:
        raise ckpt.CorruptCheckpointError(f"init.run_id: {ckpt.MODEL_FILE} of run {init.run_id!r} in {folder} "
                                          f"{wrong}; run the job again to download it afresh")


def load_init(objective, init: Init, answers: list[str] | None, answer_head_from_qa: bool) -> str:
    """Load the starting weights into the objective's model; returns a line saying what was loaded."""
    from xmodal.models.lxmert.init import (
        encoder_state_from_hf_dir,
        init_answer_head_from_qa,
        load_finetuned_head,
        load_pretrained_encoder,
        reference_weights,
    )

    if init.source == "scratch":
        return "from scratch"
    if init.source == "reference":
        weights = reference_weights(init.path)
        load_pretrained_encoder(objective.model, weights.state)
        line = f"encoder from reference {init.path}"
        if weights.head is not None:
            loaded = load_finetuned_head(objective.model, weights)
            line += (f"; {weights.head} from the snapshot" if loaded else
                     f"; the snapshot's {weights.head} does not fit this model's head (another task or answer "
                     "count): the head starts fresh")
        # A pretrained snapshot's QA head stays unused: the reference's answer table is not in the file.
        return line
    if init.source == "transformers":
        _, state = encoder_state_from_hf_dir(init.path)
        pretrain_answers = None  # transformers' checkpoints carry no answer table
    else:
        with run_weights_here(init) as folder:
            state = torch.load(folder / ckpt.MODEL_FILE, map_location="cpu", weights_only=True)
        pretrain_answers = init.pretrain_answers
    model = objective.model
    load_pretrained_encoder(model, state)
    line = f"encoder from {init.source} {init.run_id or init.path}"
    if answer_head_from_qa and answers is not None and pretrain_answers is not None and hasattr(model, "answer_head"):
        from xmodal.data.answers import AnswerTable

        table = AnswerTable(pretrain_answers)
        n = init_answer_head_from_qa(model, state, [table.index(a) for a in answers],
                                     num_pretrain_answers=len(pretrain_answers))
        line += f"; answer head: {n} of {len(answers)} answers from the pretraining QA head"
    return line

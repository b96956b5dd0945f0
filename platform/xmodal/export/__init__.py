"""Models leave xmodal (`jobs/export.py`, docs/export.md): a trained model (`export.source`: an MLflow
run, a checkpoint folder, a logged model) written in a format other code loads.

Targets (`TARGETS`):
- `transformers`: a directory `from_pretrained` loads (config.json, model.safetensors, the tokenizer
  files when the run's store has a vocabulary): `LxmertForPreTraining` for the pretraining model,
  `LxmertForQuestionAnswering` for a VQA / GQA one; transformers has no NLVR2 model, so an NLVR2
  model is `LxmertModel` (the encoder) plus its pair classifier in `nlvr2_classifier.safetensors`.
  The weight mapping is `models/lxmert/hf.py`'s, inverted (`to_hf_state_dict`).
- `reference`: the reference code's snapshot (airsplay/lxmert): `model_LXRT.pth` for the pretraining
  model, a task's `BEST.pth` for a fine-tuned one (`models/lxmert/init.py: to_reference_state_dict`),
  which our `--init reference` reads back.
- `mult-reference`: MulT as the reference MULTModel's state dict (yaohungt/Multimodal-Transformer,
  `models/mult/reference.py`) with its `hyp_params` in `hyp_params.json`.

What a target cannot hold is refused before anything is written (an `ExportError` naming the model
option or variant and the target). `--out` is checked first, under the output policy
(`xmodal.base.outputs.Output`: a new or empty local folder, or this command's own earlier export, which is
replaced; with `--overwrite` a folder holding other files, which stay), written into a stage beside it
and published whole at the end. Every output has `xmodal_export.json`: the
source, which weights (selected on validation, and on which metric, or the last), the files and the
notes (what was adapted, e.g. a zero token-type table).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.base.outputs import Output
from xmodal.export.source import Source, from_checkpoint, from_logged_model, from_run

PROVENANCE_FILE = "xmodal_export.json"
NLVR2_HEAD_FILE = "nlvr2_classifier.safetensors"
MULT_WEIGHTS_FILE = "mult_reference.pth"
MULT_HYPERPARAMETERS_FILE = "hyp_params.json"


class ExportError(UserError):
    """The model cannot be written to the target, or the output folder is not free."""


@dataclass
class Plan:
    """A target's checked plan: `write(folder)` writes the files and returns their names."""

    write: Callable[[Path], list[str]]
    notes: list[str] = field(default_factory=list)
    what: str = ""  # what the output is, for the summary line


@dataclass
class ExportResult:
    out: Path
    files: list[str]
    notes: list[str]
    what: str


def _refuse(target: str, source: Source, problems: list[str]) -> None:
    if problems:
        raise ExportError(f"--to {target} cannot hold this {source.kind} model ({source.origin}): "
                          + "; ".join(problems))


def _lxmert_only(target: str, source: Source, instead: str) -> None:
    if source.kind == "mult":
        raise ExportError(f"--to {target}: {source.origin} is a MulT model; {target} holds LXMERT models ({instead})")


# ------------------------------------------------------------------------------- transformers


def _transformers(source: Source) -> Plan:
    _lxmert_only("transformers", source, "MulT: --to mult-reference")
    from xmodal.models.lxmert.hf import hf_incompatibilities

    model = source.model
    c = model.config
    _refuse("transformers", source, [f"model.{p}" for p in hf_incompatibilities(c)])
    try:
        import transformers  # noqa: F401  (an optional dependency: checked before anything is written)
    except ImportError:
        raise ExportError("--to transformers needs the transformers package (pip install 'transformers>=4.40')") \
            from None
    notes = []
    if not c.token_type_embedding:
        notes.append("the model has no token-type embedding: token_type_embeddings is a zero table (type 0 adds "
                     "row 0, so the outputs are the same)")
    if source.vocab is None:
        notes.append("no tokenizer files: the run's store has no vocab.txt (or is no longer there)")
    what = {"pretrain": "LxmertForPreTraining", "vqa": "LxmertForQuestionAnswering",
            "gqa": "LxmertForQuestionAnswering", "nlvr2": f"LxmertModel + {NLVR2_HEAD_FILE}"}[source.kind]
    if source.kind == "nlvr2":
        notes.append(f"transformers has no NLVR2 model: the encoder is an LxmertModel, the pair classifier "
                     f"({model.output} output) is {NLVR2_HEAD_FILE}: logits = fc2(LayerNorm(GeLU(fc1([pooled(img0, "
                     "s); pooled(img1, s)])))), eps in config.json's layer_norm_eps (1e-12)")

    def write(folder: Path) -> list[str]:
        import transformers

        from xmodal.models.lxmert.hf import config_to_hf, to_hf_state_dict

        transformers.utils.logging.disable_progress_bar()  # its shard-writing bar is not our console's

        sd = model.state_dict()
        if source.kind == "pretrain":
            cls, hf_config = transformers.LxmertForPreTraining, config_to_hf(c, zero_token_type=True)
            weights = to_hf_state_dict(c, sd, "pretraining")
        elif source.kind in ("vqa", "gqa"):
            cls = transformers.LxmertForQuestionAnswering
            hf_config = config_to_hf(c, zero_token_type=True, num_qa_labels=model.num_answers)
            weights = to_hf_state_dict(c, sd, "qa")
        else:
            cls, hf_config = transformers.LxmertModel, config_to_hf(c, zero_token_type=True)
            encoder = {k: v for k, v in sd.items() if k.startswith("encoder.")}
            weights = {k.removeprefix("lxmert."): v for k, v in to_hf_state_dict(c, encoder, "encoder").items()}
        # Built on the meta device and given our tensors (copies: q/k/v are views of one in_proj), so
        # transformers' random initialisation (most of a paper-size export's time) never runs.
        with torch.device("meta"):
            hf = cls(hf_config)
        hf.load_state_dict({k: v.clone() for k, v in weights.items()}, strict=True, assign=True)  # every entry, both ways
        hf.tie_weights()  # the MLM decoder is the word embedding again (one tensor)
        left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
        if left:
            raise ExportError(f"transformers' {cls.__name__} kept entries our weights do not give: {', '.join(left[:6])}")
        hf.save_pretrained(folder, safe_serialization=True)
        if source.kind == "nlvr2":
            from safetensors.torch import save_file

            head = {k: v.detach().contiguous() for k, v in model.classifier.state_dict().items()}
            save_file(head, str(folder / NLVR2_HEAD_FILE), metadata={"output": model.output})
        if source.vocab is not None:
            tok = _tokenizer(transformers, source.vocab, c.max_positions)
            tok.save_pretrained(folder)
            shutil.copyfile(source.vocab, folder / "vocab.txt")  # BERT tokenizers elsewhere read this one
        return sorted(p.name for p in folder.iterdir())

    return Plan(write, notes, what)


def _tokenizer(transformers, vocab: Path, max_positions: int):
    """transformers' LXMERT tokenizer (BERT uncased WordPiece, as data/tokenizer.py) over the store's
    vocab.txt. transformers 5 takes the file as `vocab`, 4.x as `vocab_file`."""
    import inspect

    cls = transformers.LxmertTokenizerFast
    arg = "vocab" if "vocab" in inspect.signature(cls.__init__).parameters else "vocab_file"
    tok = cls(**{arg: str(vocab)}, do_lower_case=True, model_max_length=max_positions)
    lines = len(vocab.read_text(encoding="utf-8").splitlines())
    if len(tok) != lines:
        raise ExportError(f"{vocab}: transformers' tokenizer read {len(tok)} tokens of its {lines} lines")
    return tok


# ------------------------------------------------------------------------------- reference LXMERT


def _reference(source: Source) -> Plan:
    _lxmert_only("reference", source, "MulT: --to mult-reference")
    from xmodal.models.lxmert.init import reference_incompatibilities

    model = source.model
    c = model.config
    problems = [f"model.{p}" for p in reference_incompatibilities(c)]
    if source.kind == "nlvr2" and model.output != "softmax":
        problems.append(f"nlvr2_output={model.output!r} (the reference's NLVR2 classifier is a 2-way softmax: "
                        "nlvr2_output='softmax')")
    _refuse("reference", source, problems)
    head = {"pretrain": None, "vqa": "answer_head", "gqa": "answer_head", "nlvr2": "classifier"}[source.kind]
    name = "model_LXRT.pth" if head is None else "BEST.pth"
    notes = ["a reference snapshot holds no config: --init reference reads the sizes from the shapes and takes "
             f"bert-base's dropout 0.1 and initializer_range 0.02 (this model: dropout {c.dropout}, "
             f"initializer_range {c.initializer_range})"]
    if not c.token_type_embedding:
        notes.append("the model has no token-type embedding: bert.embeddings.token_type_embeddings is a zero table")

    def write(folder: Path) -> list[str]:
        from xmodal.models.lxmert.init import to_reference_state_dict

        torch.save(to_reference_state_dict(c, model.state_dict(), head), folder / name)
        return [name]

    return Plan(write, notes, "the pretrained LXRTPretraining snapshot" if head is None
                else f"a fine-tuned {source.kind} task snapshot")


# ------------------------------------------------------------------------------- reference MulT


def _mult_reference(source: Source) -> Plan:
    if source.kind != "mult":
        raise ExportError(f"--to mult-reference: {source.origin} is an LXMERT {source.kind} model; mult-reference "
                          "holds MulT models (LXMERT: --to transformers or --to reference)")
    from xmodal.models.mult.reference import reference_hyperparameters, reference_incompatibilities

    c = source.model.config
    _refuse("mult-reference", source, [f"model.{p}" for p in reference_incompatibilities(c)])
    notes = []
    if c.text_dropout != c.embed_dropout:
        notes.append(f"text_dropout {c.text_dropout} differs from embed_dropout {c.embed_dropout}: the reference "
                     "drops the text with embed_dropout (written as it is)")
    if c.variant != "full":
        notes.append(f"variant {c.variant}: MULTModel builds all three trans_<m>_mem and uses one; the other two are "
                     "written with zero weights and unit LayerNorms")

    def write(folder: Path) -> list[str]:
        from xmodal.models.mult.reference import to_reference_state_dict

        torch.save(to_reference_state_dict(source.model), folder / MULT_WEIGHTS_FILE)
        (folder / MULT_HYPERPARAMETERS_FILE).write_text(json.dumps(reference_hyperparameters(c), indent=2) + "\n")
        return [MULT_WEIGHTS_FILE, MULT_HYPERPARAMETERS_FILE]

    return Plan(write, notes, "MULTModel's state dict and its hyp_params")


TARGETS: dict[str, Callable[[Source], Plan]] = {
    "transformers": _transformers,
    "reference": _reference,
    "mult-reference": _mult_reference,
}


# ------------------------------------------------------------------------------- writing


def export(source: Source, to: str, out: str | Path | Output, overwrite: bool = False) -> ExportResult:
    """Write `source`'s model for target `to` as the folder `out` (see the module's docstring): checked by
    the output policy first (`Output`), written into a stage beside it, published whole."""
    if to not in TARGETS:
        raise ExportError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    output = out if isinstance(out, Output) else export_output(out, overwrite)
    plan = TARGETS[to](source)  # every refusal happens here, before a file is written
    plan.notes = [*source.notes, *plan.notes]
    with output.stage() as stage:
        files = plan.write(stage.tmp)
        (stage.tmp / PROVENANCE_FILE).write_text(json.dumps({
            "target": to, "what": plan.what, "kind": source.kind, "source": source.origin, "run_id": source.run_id,
            "weights": source.weights, "selected_on": source.selected_on, "files": files, "notes": plan.notes},
            indent=2) + "\n")
        stage.publish()
    return ExportResult(output.path, [*files, PROVENANCE_FILE], plan.notes, plan.what)


def export_output(out: str | Path, overwrite: bool) -> Output:
    """`--out` under the output policy: a new or empty local folder, or this command's own earlier export
    (replaced); with `overwrite`, a folder holding other files, which stay."""
    return Output(out, "--out", "export", overwrite=overwrite)


def run_export(to: str, out: str, *, run_id: str | None = None, checkpoint: str | None = None,
               logged_model: str | None = None, tracking_uri: str | None = None, overwrite: bool = False
               ) -> ExportResult:
    """The command line's work: read the one source named, export it, say what was written."""
    from xmodal import tracking

    named = [n for n, v in (("--run-id", run_id), ("--checkpoint", checkpoint), ("--logged-model", logged_model))
             if v is not None]
    if len(named) != 1:
        raise ExportError("name one source: --run-id ID, --checkpoint DIR or --logged-model URI"
                          + (f" (got {', '.join(named)})" if named else ""))
    if to not in TARGETS:  # before a run is downloaded
        raise ExportError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    if logged_model is not None and not logged_model.startswith(("models:/", "runs:/")):
        raise ExportError(f"--logged-model {logged_model!r}: expected models:/MODEL_ID or runs:/RUN_ID/final_model")
    # before any work, named as the option; a checkpoint needs no store unless one is named
    uri = tracking.resolve_tracking_uri(tracking_uri, "--tracking-uri") \
        if checkpoint is None or tracking_uri is not None else None
    output = export_output(out, overwrite)
    with tempfile.TemporaryDirectory(prefix="xmodal-export-") as work:
        if checkpoint is not None:
            source = from_checkpoint(checkpoint)
        else:
            tracking.check_existing_store(uri)  # reading never creates a database
            source = (from_run(uri, run_id, Path(work)) if run_id is not None
                      else from_logged_model(uri, logged_model, Path(work)))
        result = export(source, to, output)
    say(f"[xmodal] exported the {source.kind} model of {source.origin} ({source.describe_weights()}) to "
        f"{result.out}: {result.what}")
    say(f"[xmodal]   files: {', '.join(result.files)}")
    for note in result.notes:
        say(f"[xmodal]   note: {note}")
    return result

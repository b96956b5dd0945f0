"""A finished fine-tuning run's examples, re-evaluated: its model (the `model` artifact: the weights it
selected on validation, `export.source.from_run`), its fine-tuning set (the run's `finetune_set` tag),
and for each chosen example of a split the question or statement, the gold answers, the prediction with
its top 5, and the language side's cross-attention over the boxes, recorded by a hook on the model only
for these examples (`models.lxmert.recording_cross_attention`).

Only the chosen examples' images are read (their row groups, `image_rows`), never a whole store. Every
bad input is an `ExamplesError` naming the option, the value and what was expected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.errors import UserError

log = logging.getLogger(__name__)

TASKS = ("vqa", "gqa", "nlvr2")
TOP = 5  # answers listed per example
META_COLUMNS = ("img_h", "img_w", "num_boxes", "boxes", "obj_ids", "obj_conf", "attr_ids", "attr_conf")
SYNTHETIC_SIZE = (640, 480)  # the synthetic store's img_w, img_h (data/lxmert/synthetic.py)
BLANK_SIZE = (640, 480)  # a canvas for an image whose store records no size


class ExamplesError(UserError):
    """Bad input to the examples pages: the message names the option, the value and what was expected."""


@dataclass
class Box:
    xyxy: tuple[float, float, float, float]  # normalised to the image: x1 y1 x2 y2 in [0, 1]
    obj: int  # the detector's object id (-1: none)
    attr: int  # its attribute id (-1: none)
    obj_conf: float
    attr_conf: float
    label: str  # "attribute object" by name where the store has names, else by id
    obj_name: str | None = None
    attr_name: str | None = None


@dataclass
class Picture:
    img_id: str
    width: int
    height: int
    boxes: list[Box]
    kind: str  # "file" (the image itself), "synthetic" (its scene drawn), "blank" (no image known),
    #            "missing" (its recorded file is not there)
    source: str | None = None  # the image's path or URI where the store records one


@dataclass
class Example:
    row: int  # in the split
    id: str  # question_id or identifier
    text: str
    tokens: list[str]  # [CLS], the words, [SEP]: the attention's rows
    pictures: list[Picture]  # one (VQA, GQA) or two (NLVR2)
    gold: list[tuple[str, float]]  # answers with their scores (NLVR2: the label, score 1)
    pred: str
    top: list[tuple[str, float]]  # the TOP answers and their probabilities
    score: float  # the job's own score of the prediction (VQA: its soft score; GQA, NLVR2: 0 or 1)
    attention: np.ndarray  # (L, P, H, T, N) float32: layer, picture, head, token, box

    @property
    def right(self) -> bool:
        return self.score > 0


@dataclass
class RunExamples:
    run_id: str
    run_name: str
    task: str
    split: str
    set_path: str
    examples: list[Example]
    split_size: int
    notes: list[str] = field(default_factory=list)  # what the pages should say about the pictures


def check_count(n: int, key: str = "--examples") -> int:
    if n < 1:
        raise ExamplesError(f"{key} {n}: expected at least 1 example")
    return n


def run_task(run: tracking.RunRecord, key: str) -> str:
    """The task of a run whose examples have pages: a fine-tuning task (the `task` tag `finetune-<task>`),
    `pretrain` (its QA head) or `mult` (its `model` tag); else an error saying what the run is."""
    task = run.tags.get(run_tags.TASK, "")
    if run.tags.get(run_tags.MODEL) == "mult":
        return "mult"
    if task.startswith("finetune-") and task[len("finetune-"):] in TASKS:
        return task[len("finetune-"):]
    if task == "pretrain":
        return task
    what = f"a {task!r} run" if task else "a run without a task tag"
    raise ExamplesError(f"{key}: run {run.run_id!r} is {what}; expected a fine-tuning run "
                        f"({', '.join('finetune-' + t for t in TASKS)}), a pretraining run (its QA head) or a "
                        "MulT run")


def get_run(uri: str, run_id: str, key: str) -> tracking.RunRecord:
    local = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if local is not None and not Path(local).exists():  # a read must not create a database
        raise ExamplesError(f"{key}: no MLflow run {run_id!r}: there is no MLflow store at {local}")
    try:
        return tracking.get_run(uri, run_id)
    except tracking.RunNotFound:
        raise ExamplesError(f"{key}: no MLflow run {run_id!r} at {uri}") from None


def check_data_unchanged(run: tracking.RunRecord, path: str, key: str) -> None:
    """The data at `path` is the data the run read: its manifest's digest equals the one the run recorded
    (`run_tags.REPRO_DATA_MANIFEST`). Data ingested again since would give other examples than the run
    evaluated, with no error."""
    from xmodal.runner.run_record import manifest_digest

    recorded = run.tags.get(run_tags.REPRO_DATA_MANIFEST)
    found = manifest_digest(path)
    if recorded and recorded != "-" and found != recorded:
        raise ExamplesError(f"{key}: {path} is not the data run {run.run_id!r} read: its manifest's digest is "
                            f"{found}, the run recorded {recorded}; expected the data as it was (was it "
                            "ingested again since?)")


def open_recorded(run: tracking.RunRecord, key: str, tag: str, what: str, opener):
    """The data the run recorded under `tag` (its path), checked unchanged and opened with `opener`."""
    path = run.tags.get(tag)
    if not path:
        raise ExamplesError(f"{key}: run {run.run_id!r} records no {what} (tag {tag!r})")
    check_data_unchanged(run, path, key)
    try:
        return opener(path)
    except UserError as e:
        raise ExamplesError(f"{key}: the {what} of run {run.run_id!r} cannot be opened: {e}") from None


def open_set(run: tracking.RunRecord, key: str):
    """The fine-tuning set the run read (its `finetune_set` tag), opened and checked."""
    from xmodal.data.finetune.sets import open_finetune

    return open_recorded(run, key, run_tags.FINETUNE_SET, "fine-tuning set", open_finetune)


def check_split(data, split: str, run_id: str) -> None:
    """A split the run evaluated: every split of its set but train (`FinetuneJob.held_out`)."""
    evaluated = [s for s in data.splits if s != "train"]
    if split not in evaluated:
        why = "trains on it" if split == "train" else "has no such split"
        raise ExamplesError(f"--split {split}: run {run_id!r} did not evaluate it (its set {why}); it evaluated "
                            f"{', '.join(evaluated)}")


def choose_rows(size: int, n: int) -> np.ndarray:
    """`n` rows of a split of `size`, the same for every run of the same set: a fixed-seed sample, in order."""
    n = min(n, size)
    return np.sort(np.random.default_rng(0).choice(size, n, replace=False)).astype(np.int64)


# ----------------------------------------------------------------------------- names and pictures


def label_names(store) -> tuple[list[str] | None, list[str] | None]:
    """(object names, attribute names) of an image store: the synthetic store's own class and colour
    names, the vocabularies an extraction recorded (`--objects-vocab/--attributes-vocab`; the first
    synonym of each line), or None where it has none."""
    m = store.manifest
    if getattr(m, "source", None) == "synthetic":
        from xmodal.data.lxmert.synthetic import class_names, colour_names

        return class_names(m.num_object_labels), colour_names(m.num_attr_labels)
    vocab = (getattr(m, "options", None) or {}).get("vocab") or {}

    def first(names):
        return [str(n).split(",")[0] for n in names] if isinstance(names, list) else None

    return first(vocab.get("objects")), first(vocab.get("attributes"))


def is_synthetic(store) -> bool:
    return getattr(store.manifest, "source", None) == "synthetic"


def store_sources(store) -> dict[str, str]:
    """img_id -> the image's path or URI, as the store records it; {} where it records none: a feature
    store from a reference TSV, or an LXMERT store (ingest does not carry the sources over)."""
    from xmodal.data.lxmert.features import FeatureStore, image_sources

    if not isinstance(store, FeatureStore):
        return {}
    try:
        return image_sources(store)
    except (OSError, ValueError, KeyError) as e:
        log.warning("[xmodal] the image sources of %s cannot be read (%s): drawing blank canvases", store.path, e)
        return {}


def name_of(i: int, names: list[str] | None) -> str | None:
    return names[i] if names is not None and 0 <= i < len(names) else None


def box_label(obj: int, attr: int, objects: list[str] | None, attributes: list[str] | None) -> str:
    o = name_of(obj, objects) or f"obj {obj}"
    if attr < 0:
        return o
    return f"{name_of(attr, attributes) or f'attr {attr}'} {o}"


def image_rows(data, img_ids: list[str], columns: tuple[str, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """img_id -> {column: value} for `img_ids`, reading only the row groups that hold them, and img_id ->
    the index of the image store it came from."""
    from xmodal.data.common import open_parquet
    from xmodal.data.finetune.sets import _tensor

    index = data.store_index()
    out: dict[str, dict[str, Any]] = {}
    where: dict[str, int] = {}
    by_file: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for img in img_ids:
        i, file, row = index[img]
        by_file.setdefault((i, file), []).append((row, img))
        where[img] = i
    for (i, file), wanted in by_file.items():
        store = data.image_stores[i]
        md = open_parquet(store.path / file).metadata
        starts = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
        for g in sorted({int(np.searchsorted(starts, r, side="right") - 1) for r, _ in wanted}):
            table = store.read_table(file, [g], columns=list(columns))
            cols = {c: (_tensor(table.column(c)) if hasattr(table.column(c).type, "shape")
                        else table.column(c).to_numpy()) for c in columns}
            for r, img in wanted:
                if starts[g] <= r < starts[g + 1]:
                    out[img] = {c: v[r - starts[g]] for c, v in cols.items()}
    return out, where


def picture_of(img: str, r: dict[str, Any], store, sources: dict[str, str], missing: list[str]) -> Picture:
    """The Picture of image `img` of `store` from its row `r` (boxes labelled, where its pixels come from);
    a recorded file that is not there goes to `missing`."""
    objects, attributes = label_names(store)
    boxes = []
    for j in range(int(r["num_boxes"])):
        o, a = int(r["obj_ids"][j]), int(r["attr_ids"][j])
        boxes.append(Box(tuple(float(v) for v in r["boxes"][j]), o, a, float(r["obj_conf"][j]),
                         float(r["attr_conf"][j]), box_label(o, a, objects, attributes), name_of(o, objects),
                         name_of(a, attributes)))
    w, h = int(r["img_w"]), int(r["img_h"])
    src = sources.get(img)
    if is_synthetic(store):
        kind = "synthetic"
        w, h = (w, h) if w > 0 and h > 0 else SYNTHETIC_SIZE
    elif src is not None and ("://" in src or Path(src).is_file()):
        kind = "file"
    elif src is not None:
        kind = "missing"
        missing.append(src)
    else:
        kind = "blank"
    if w <= 0 or h <= 0:
        w, h = BLANK_SIZE
    return Picture(img, w, h, boxes, kind, src)


def say_pictures(pictures: list[Picture], missing: list[str], notes: list[str]) -> None:
    """One warning line for images no longer where the store recorded them, and the pages' notes."""
    if missing:
        log.warning("[xmodal] %d image file(s) of the store are not where it records them (e.g. %s): drawn on blank "
                    "canvases", len(missing), missing[0])
        notes.append(f"{len(missing)} picture(s) are not where the store records them (e.g. {missing[0]}): their "
                     "boxes are drawn on a blank canvas of the image's size")
    kinds = {p.kind for p in pictures}
    if "blank" in kinds:
        notes.append("the image store records no pictures: boxes are drawn on a blank canvas of each image's size")
    if "synthetic" in kinds:
        notes.append("synthetic images: each scene is drawn from the store's own boxes, classes and colours")


def pictures_of(data, img_ids: list[str], notes: list[str]) -> tuple[dict[str, Picture], dict[str, dict]]:
    """A Picture of each image of a fine-tuning set, and the model's inputs of each."""
    rows, where = image_rows(data, img_ids, ("features", *META_COLUMNS))
    sources = [store_sources(st) for st in data.image_stores]
    missing: list[str] = []
    pictures = {img: picture_of(img, rows[img], data.image_stores[where[img]], sources[where[img]], missing)
                for img in img_ids}
    say_pictures(list(pictures.values()), missing, notes)
    return pictures, rows


# ----------------------------------------------------------------------------- the model on the examples


def token_names(store, ids: np.ndarray) -> list[str]:
    """The tokens of one input_ids row up to its [SEP]: special tokens by name, word pieces as they are."""
    tok = store.tokenizer()
    special = {v: k for k, v in tok.special_ids.items()}
    out = []
    for i in ids.tolist():
        if i == tok.pad_id:
            break
        out.append(special.get(i) or tok.decode([i]) or f"#{i}")
    return out


def gold_of(data, sp, row: int) -> list[tuple[str, float]]:
    if sp.is_qa:
        lo, hi = int(sp.ans_offsets[row]), int(sp.ans_offsets[row + 1])
        return sorted(((data.answers.answer(int(a)), float(s)) for a, s in
                       zip(sp.ans_ids[lo:hi], sp.ans_scores[lo:hi], strict=True)), key=lambda t: -t[1])
    label = int(sp.labels[row])
    return [] if label < 0 else [("true" if label == 1 else "false", 1.0)]


@torch.no_grad()
def evaluate(model, data, split: str, rows: np.ndarray, notes: list[str], batch_size: int = 16) -> list[Example]:
    """The model on the examples `rows` of `split`: predictions, top answers, scores and cross-attention."""
    from xmodal.models.lxmert import recording_cross_attention

    sp = data.split(split)
    pair = not sp.is_qa
    img_of = [list(sp.img_ids[r]) if pair else [sp.img_ids[r]] for r in rows.tolist()]
    uniq = sorted({str(i) for imgs in img_of for i in imgs})
    pictures, inputs = pictures_of(data, uniq, notes)
    model = model.float().eval()
    examples: list[Example] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        imgs = [[str(i) for i in img_of[start + k]] for k in range(len(chunk))]
        feats = torch.from_numpy(np.stack([[inputs[i]["features"] for i in im] for im in imgs]).astype(np.float32))
        boxes = torch.from_numpy(np.stack([[inputs[i]["boxes"] for i in im] for im in imgs]).astype(np.float32))
        n_obj = feats.shape[2]
        vmask = torch.from_numpy(np.stack([[np.arange(n_obj) < int(inputs[i]["num_boxes"]) for i in im]
                                           for im in imgs]))
        ids = torch.from_numpy(sp.input_ids[chunk].astype(np.int64))
        if not pair:
            feats, boxes, vmask = feats[:, 0], boxes[:, 0], vmask[:, 0]
        with recording_cross_attention(model.encoder) as found:
            logits = model(ids, ids != 0, feats, boxes, vmask).float()
        att = torch.stack(found).cpu().numpy()  # (L, B*P, H, T, N)
        p = 2 if pair else 1
        att = att.reshape(att.shape[0], len(chunk), p, *att.shape[2:])  # (L, B, P, H, T, N)
        for k, row in enumerate(chunk.tolist()):
            tokens = token_names(data.store, sp.input_ids[row])
            gold = gold_of(data, sp, row)
            if pair:
                if logits.shape[-1] == 1:
                    pt = float(torch.sigmoid(logits[k, 0]))
                    pred = "true" if logits[k, 0] > 0 else "false"
                else:
                    probs = logits[k].softmax(-1)
                    pt = float(probs[1])
                    pred = "true" if int(logits[k].argmax()) == 1 else "false"
                top = sorted([("true", pt), ("false", 1 - pt)], key=lambda t: -t[1])
                score = float(bool(gold) and gold[0][0] == pred)
            else:
                probs = logits[k].softmax(-1)
                pi = int(logits[k].argmax())
                pred = data.answers.answer(pi)
                vals, idx = probs.topk(min(TOP, probs.shape[0]))
                top = [(data.answers.answer(int(i)), float(v)) for v, i in zip(vals, idx, strict=True)]
                s = dict(gold).get(pred, 0.0)
                score = float(s > 0) if data.task == "gqa" else float(s)
            text = data.store.tokenizer().decode(sp.input_ids[row])
            examples.append(Example(
                row=row, id=str(sp.ids[row]), text=text, tokens=tokens,
                pictures=[pictures[i] for i in imgs[k]], gold=gold, pred=pred, top=top, score=score,
                attention=np.ascontiguousarray(att[:, k, :, :, :len(tokens)], dtype=np.float32)))
    return examples


def collect(uri: str, run_id: str, split: str, n: int, download_dir: Path, key: str = "--run-id",
            rows: np.ndarray | None = None) -> tuple[RunExamples, Any]:
    """The run's examples of `split`: `n` chosen rows (or `rows`), re-evaluated with its model. Returns
    them and the opened set or store (for a second run's check)."""
    from xmodal.export.source import from_run

    check_count(n)
    run = get_run(uri, run_id, key)
    task = run_task(run, key)
    if task == "pretrain":
        store = open_pretrain_store(run, key)
        check_pretrain_split(store, split, run_id)
        source = from_run(uri, run_id, download_dir)
        notes: list[str] = []
        examples, size = evaluate_pretrain(source.model, store, split, n, notes, rows)
        return RunExamples(run_id, run.name, task, split, str(store.path), examples, size, notes), store
    data = open_set(run, key)
    check_split(data, split, run_id)
    source = from_run(uri, run_id, download_dir)
    size = len(data.split(split))
    chosen = choose_rows(size, n) if rows is None else rows
    notes: list[str] = []
    examples = evaluate(source.model, data, split, chosen, notes)
    return RunExamples(run_id, run.name, task, split, str(data.path), examples, size, notes), data


# ----------------------------------------------------------------------------- pretraining: the QA head

PRETRAIN_SPLIT = "minival"  # the split a pretraining run evaluates


def open_pretrain_store(run: tracking.RunRecord, key: str):
    from xmodal.data.lxmert.store import open_store

    return open_recorded(run, key, run_tags.STORE, "store", open_store)


def check_pretrain_split(store, split: str, run_id: str) -> None:
    if split != PRETRAIN_SPLIT or not store.manifest.shards.get(split):
        raise ExamplesError(f"--split {split}: pretraining run {run_id!r} did not evaluate it; its QA head is "
                            f"evaluated on {PRETRAIN_SPLIT}" + ("" if store.manifest.shards.get(PRETRAIN_SPLIT) else
                                                                f", which its store {store.path} lacks"))


def store_questions(store, split: str) -> list[tuple[str, int, int]]:
    """(shard file, image row in the shard, sentence of the image) of every question of a store split (the
    sentences with answers), reading only the answer column."""
    out = []
    for shard in store.manifest.shards.get(split, []):
        answers = store.read_table(shard.file, columns=["answer_ids"]).column("answer_ids").to_pylist()
        out += [(shard.file, r, k) for r, sents in enumerate(answers) for k, a in enumerate(sents) if a]
    return out


@torch.no_grad()
def evaluate_pretrain(model, store, split: str, n: int, notes: list[str], rows: np.ndarray | None = None
                      ) -> tuple[list[Example], int]:
    """The pretraining model's QA head on `n` questions of a store split (or the questions `rows`), with
    its cross-attention: only the row groups holding them are read. Returns them and the number of
    questions in the split. Right: the prediction is the most-agreed gold answer (`qa_acc`)."""
    from xmodal.data.common import open_parquet
    from xmodal.data.lxmert.store import table_to_block
    from xmodal.models.lxmert import recording_cross_attention

    qs = store_questions(store, split)
    if not qs:
        raise ExamplesError(f"{store.path}: split {split!r} holds no questions (sentences with answers) to show")
    chosen = choose_rows(len(qs), n) if rows is None else rows
    answers = store.answers()
    sources = store_sources(store)
    model = model.float().eval()
    by_group: dict[tuple[str, int], list[int]] = {}
    starts_of: dict[str, np.ndarray] = {}
    for q in chosen.tolist():
        file, r, _ = qs[q]
        if file not in starts_of:
            md = open_parquet(store.path / file).metadata
            starts_of[file] = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
        g = int(np.searchsorted(starts_of[file], r, side="right") - 1)
        by_group.setdefault((file, g), []).append(q)
    found_examples: dict[int, Example] = {}
    missing: list[str] = []
    for (file, g), group in by_group.items():
        b = table_to_block(store.read_table(file, [g]))
        for q in group:
            _, r, k = qs[q]
            i = r - int(starts_of[file][g])
            si = int(b.sent_offsets[i]) + k
            img = str(b.img_id[i])
            row = {c: getattr(b, c)[i] for c in META_COLUMNS}
            pic = picture_of(img, row, store, sources, missing)
            ids = torch.from_numpy(b.input_ids[si:si + 1].astype(np.int64))
            n_obj = b.features.shape[1]
            with recording_cross_attention(model.encoder) as found:
                out = model.encoder(ids, ids != 0, torch.from_numpy(b.features[i:i + 1].astype(np.float32)),
                                    torch.from_numpy(b.boxes[i:i + 1].astype(np.float32)),
                                    torch.from_numpy(np.arange(n_obj)[None] < int(b.num_boxes[i])))
            probs = model.qa_head(out.pooled).float()[0].softmax(-1)
            lo, hi = int(b.ans_offsets[si]), int(b.ans_offsets[si + 1])
            gold = sorted(((answers.answer(int(a)), float(sc)) for a, sc in
                           zip(b.ans_ids[lo:hi], b.ans_scores[lo:hi], strict=True)), key=lambda t: -t[1])
            pred = answers.answer(int(probs.argmax()))
            vals, idx = probs.topk(min(TOP, probs.shape[0]))
            tokens = token_names(store, b.input_ids[si])
            att = torch.stack(found).cpu().numpy()[:, :, :, :len(tokens)]  # (L, 1, H, T, N): one picture
            found_examples[q] = Example(
                row=q, id=f"{img}-{k}", text=store.tokenizer().decode(b.input_ids[si]), tokens=tokens,
                pictures=[pic], gold=gold, pred=pred,
                top=[(answers.answer(int(j)), float(v)) for v, j in zip(vals, idx, strict=True)],
                score=float(bool(gold) and pred == gold[0][0]), attention=np.ascontiguousarray(att, np.float32))
    examples = [found_examples[q] for q in chosen.tolist()]
    say_pictures([e.pictures[0] for e in examples], missing, notes)
    return examples, len(qs)

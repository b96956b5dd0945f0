"""The fine-tuning kind: a run's examples of a split of its fine-tuning set (the run's `finetune_set` tag),
re-evaluated with its model (VQA, GQA: the question, the gold answers, the top answers; NLVR2: the
statement over its two pictures), with the language side's cross-attention over the boxes recorded by a
hook only for these examples (`models.lxmert.recording_cross_attention`).

Only the chosen examples' images are read (their row groups, `image_rows`), never a whole store.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from xmodal.base import run_tags
from xmodal.examples.pictures import META_COLUMNS, Picture, picture_of, say_pictures, store_sources
from xmodal.examples.qa import Example, QaRender, answer_example, token_names
from xmodal.examples.run import ExamplesError, Resolved, choose_rows, open_recorded, rows_of

TASKS = ("vqa", "gqa", "nlvr2")


class FinetuneKind(QaRender):
    name = "finetune"
    what = "a fine-tuning run"
    default_split = "valid"

    def open(self, r: Resolved):
        """The fine-tuning set the run read, opened and checked unchanged."""
        from xmodal.data.finetune.sets import open_finetune

        return open_recorded(r, run_tags.FINETUNE_SET, "fine-tuning set", open_finetune)

    def check(self, r: Resolved, data, split: str, config: dict | None = None) -> None:
        """A split the run evaluated: every split of its set but train (`FinetuneJob.held_out`)."""
        evaluated = [s for s in data.splits if s != "train"]
        if split not in evaluated:
            why = "trains on it" if split == "train" else "has no such split"
            raise ExamplesError(f"--split {split}: run {r.run_id!r} did not evaluate it (its set {why}); it "
                                f"evaluated {', '.join(evaluated)}")

    def collect(self, model, data, split: str, n: int, notes: list[str], ids: list[str] | None = None,
                config: dict | None = None) -> tuple[list[Example], int]:
        """`n` examples of `split` (a fixed-seed sample), or those with `ids`, evaluated by `model`."""
        size = len(data.split(split))
        rows = choose_rows(size, n) if ids is None else rows_of(data.ids(split), ids, f"{data.path} split {split}",
                                                                "--compare")
        return evaluate(model, data, split, rows, notes, loss=qa_loss_of(config)), size


def qa_loss_of(config: dict | None) -> str:
    """The answer loss the run trained with (its config's `qa_loss`; NLVR2's by its head)."""
    return str((config or {}).get("qa_loss", "bce"))


def image_rows(data, img_ids: list[str], columns: tuple[str, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """img_id -> {column: value} for `img_ids`, reading only the row groups that hold them, and img_id ->
    the index of the image store it came from."""
    from xmodal.data.finetune.sets import _tensor
    from xmodal.data.location import open_parquet

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
        groups = sorted({int(np.searchsorted(starts, r, side="right") - 1) for r, _ in wanted})
        table = store.read_table(file, groups, columns=list(columns))  # one read of the file's groups
        cols = {c: (_tensor(table.column(c)) if hasattr(table.column(c).type, "shape")
                    else table.column(c).to_numpy()) for c in columns}
        at = dict(zip(groups, np.cumsum([0] + [int(starts[g + 1] - starts[g]) for g in groups]), strict=False))
        for r, img in wanted:  # row r of the file, in the table: its group's place there, plus r's place in it
            g = int(np.searchsorted(starts, r, side="right") - 1)
            out[img] = {c: v[int(at[g]) + r - int(starts[g])] for c, v in cols.items()}
    return out, where


def pictures_of(data, img_ids: list[str], notes: list[str]) -> tuple[dict[str, Picture], dict[str, dict]]:
    """A Picture of each image of a fine-tuning set, and the model's inputs of each."""
    rows, where = image_rows(data, img_ids, ("features", *META_COLUMNS))
    sources = [store_sources(st) for st in data.image_stores]
    missing: list[str] = []
    pictures = {img: picture_of(img, rows[img], data.image_stores[where[img]], sources[where[img]], missing)
                for img in img_ids}
    say_pictures(list(pictures.values()), missing, notes)
    return pictures, rows


def gold_of(data, sp, row: int) -> tuple[list[tuple[str, float]], dict[int, float]]:
    """The gold answers with their scores, most agreed first, and answer index -> score (the loss's
    targets); NLVR2: its label (index 1 = true)."""
    if sp.is_qa:
        lo, hi = int(sp.ans_offsets[row]), int(sp.ans_offsets[row + 1])
        pairs = list(zip(sp.ans_ids[lo:hi].tolist(), sp.ans_scores[lo:hi].tolist(), strict=True))
        gold = sorted(((data.answers.answer(int(a)), float(s)) for a, s in pairs), key=lambda t: -t[1])
        return gold, {int(a): float(s) for a, s in pairs}
    label = int(sp.labels[row])
    return ([], {}) if label < 0 else ([("true" if label == 1 else "false", 1.0)], {label: 1.0})


def batch_inputs(inputs: dict[str, dict], imgs: list[list[str]], pair: bool) -> tuple[torch.Tensor, ...]:
    """The model's visual inputs of a chunk of examples: features, boxes, the mask of real boxes."""
    feats = torch.from_numpy(np.stack([[inputs[i]["features"] for i in im] for im in imgs]).astype(np.float32))
    boxes = torch.from_numpy(np.stack([[inputs[i]["boxes"] for i in im] for im in imgs]).astype(np.float32))
    n_obj = feats.shape[2]
    vmask = torch.from_numpy(np.stack([[np.arange(n_obj) < int(inputs[i]["num_boxes"]) for i in im] for im in imgs]))
    if not pair:
        feats, boxes, vmask = feats[:, 0], boxes[:, 0], vmask[:, 0]
    return feats, boxes, vmask


@torch.no_grad()
def evaluate(model, data, split: str, rows: np.ndarray, notes: list[str], batch_size: int = 64,
             loss: str = "bce") -> list[Example]:
    """The model on the examples `rows` of `split`: predictions, top answers, scores, the run's loss on each
    and the cross-attention, `batch_size` examples a forward (the default count's and 48 in one)."""
    from xmodal.models.lxmert.model import recording_cross_attention

    sp = data.split(split)
    pair = not sp.is_qa
    img_of = [[str(i) for i in sp.img_ids[r]] if pair else [str(sp.img_ids[r])] for r in rows.tolist()]
    pictures, inputs = pictures_of(data, sorted({i for imgs in img_of for i in imgs}), notes)
    model = model.float().eval()
    names = data.answers.answer if sp.is_qa else (lambda i: "true" if i == 1 else "false")
    examples: list[Example] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        imgs = img_of[start:start + len(chunk)]
        ids = torch.from_numpy(sp.input_ids[chunk].astype(np.int64))
        with recording_cross_attention(model.encoder) as found:
            logits = model(ids, ids != 0, *batch_inputs(inputs, imgs, pair)).float()
        att = torch.stack(found).cpu().numpy()  # (L, B*P, H, T, N)
        p = 2 if pair else 1
        att = att.reshape(att.shape[0], len(chunk), p, *att.shape[2:])  # (L, B, P, H, T, N)
        for k, row in enumerate(chunk.tolist()):
            tokens = token_names(data.store, sp.input_ids[row])
            gold, targets = gold_of(data, sp, row)
            examples.append(answer_example(
                task=data.task, row=row, id=str(sp.ids[row]), text=data.store.tokenizer().decode(sp.input_ids[row]),
                tokens=tokens, pictures=[pictures[i] for i in imgs[k]], gold=gold, targets=targets, logits=logits[k],
                names=names, attention=att[:, k, :, :, :len(tokens)], loss=loss))
    return examples

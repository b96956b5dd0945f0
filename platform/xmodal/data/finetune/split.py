"""One split of a fine-tuning set: its examples in memory (`FinetuneSplit`, numpy) and as the Arrow table
of its Parquet file (`split_schema`, `split_to_table`, `table_to_split`); the tasks and the set's error.

Row schemas: vqa/gqa `question_id` string, `img_id` string, `input_ids` fixed_size_list<int32, T>,
`answers` list<int32>, `scores` list<float32> (soft scores; GQA has one answer with score 1);
nlvr2 `identifier`, `img0`, `img1` strings, `input_ids`, `label` int8 (1 = true, -1 = unknown, for an
unlabelled test split). The set around them: `xmodal.data.finetune.sets`. Imports numpy and pyarrow only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from xmodal.base.errors import UserError
from xmodal.data.lxmert.rows import concat_ranges

TASKS: tuple[str, ...] = ("vqa", "gqa", "nlvr2")


class FinetuneError(UserError):
    """Bad input or a bad/inconsistent fine-tuning set; the message names the file, the record or key,
    the value and what was expected."""


def check_task(task: str) -> str:
    if task not in TASKS:
        raise FinetuneError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    return task


# ============================================================================ one split in memory


@dataclass
class FinetuneSplit:
    """The E examples of one split as numpy arrays. vqa/gqa use the answer fields, nlvr2 `labels`."""

    task: str
    ids: np.ndarray  # (E,) object str: question_id (vqa/gqa) or identifier (nlvr2)
    img_ids: np.ndarray  # (E,) object str (vqa/gqa) or (E, 2) img0, img1 (nlvr2)
    input_ids: np.ndarray  # (E, T) int32 [CLS] ... [SEP] [PAD]...
    ans_offsets: np.ndarray | None = None  # (E + 1,) int64: question e owns answers [o[e], o[e+1])
    ans_ids: np.ndarray | None = None  # (M,) int32 answer-table labels
    ans_scores: np.ndarray | None = None  # (M,) float32 soft scores
    labels: np.ndarray | None = None  # (E,) int8: 1 true, 0 false, -1 unknown (nlvr2)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def is_qa(self) -> bool:
        return self.task != "nlvr2"

    def check(self, where: str, num_answers: int = 0) -> None:
        """Shape/dtype/range consistency; a bug here must not reach the Parquet files."""
        e = len(self)
        if self.input_ids.ndim != 2 or self.input_ids.shape[0] != e or self.input_ids.dtype != np.int32:
            raise FinetuneError(f"{where}: input_ids {self.input_ids.shape} {self.input_ids.dtype}, expected "
                                f"({e}, T) int32")
        if len(set(self.ids.tolist())) != e:
            raise FinetuneError(f"{where}: example ids are not unique")
        if self.is_qa:
            if self.img_ids.shape != (e,):
                raise FinetuneError(f"{where}: img_ids has shape {self.img_ids.shape}, expected ({e},)")
            if self.ans_offsets is None or self.ans_ids is None or self.ans_scores is None:
                raise FinetuneError(f"{where}: a {self.task} split needs answers")
            o = self.ans_offsets
            if o.shape != (e + 1,) or o[0] != 0 or np.any(np.diff(o) < 0) or o[-1] != len(self.ans_ids) \
                    or self.ans_scores.shape != self.ans_ids.shape:
                raise FinetuneError(f"{where}: answer offsets do not match the answer arrays")
            if len(self.ans_ids) and (self.ans_ids.min() < 0 or self.ans_ids.max() >= num_answers):
                raise FinetuneError(f"{where}: answer labels outside [0, {num_answers})")
        else:
            if self.img_ids.shape != (e, 2):
                raise FinetuneError(f"{where}: img_ids has shape {self.img_ids.shape}, expected ({e}, 2)")
            if self.labels is None or self.labels.shape != (e,) or not np.isin(self.labels, (-1, 0, 1)).all():
                raise FinetuneError(f"{where}: nlvr2 labels must be ({e},) with values -1, 0, 1")

    def targets(self, rows: np.ndarray, num_answers: int) -> np.ndarray:
        """(B, A) float32 soft score of every answer for the questions `rows` (all 0 = none known)."""
        assert self.ans_offsets is not None and self.ans_ids is not None and self.ans_scores is not None
        starts, ends = self.ans_offsets[rows], self.ans_offsets[rows + 1]
        picked = concat_ranges(starts, ends)  # (M',)
        out = np.zeros((len(rows), num_answers), np.float32)  # (B, A)
        out[np.repeat(np.arange(len(rows)), ends - starts), self.ans_ids[picked]] = self.ans_scores[picked]
        return out


def split_schema(task: str, max_seq_len: int) -> pa.Schema:
    tokens = ("input_ids", pa.list_(pa.int32(), max_seq_len))
    if task == "nlvr2":
        return pa.schema([("identifier", pa.string()), ("img0", pa.string()), ("img1", pa.string()), tokens,
                          ("label", pa.int8())])
    return pa.schema([("question_id", pa.string()), ("img_id", pa.string()), tokens,
                      ("answers", pa.list_(pa.int32())), ("scores", pa.list_(pa.float32()))])


def split_to_table(sp: FinetuneSplit) -> pa.Table:
    t = sp.input_ids.shape[1]
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(sp.input_ids.reshape(-1)), t)
    strings = lambda a: pa.array([str(x) for x in a], pa.string())  # noqa: E731
    if sp.is_qa:
        assert sp.ans_offsets is not None and sp.ans_ids is not None and sp.ans_scores is not None
        off = pa.array(sp.ans_offsets.astype(np.int32))
        cols = [strings(sp.ids), strings(sp.img_ids), tokens,
                pa.ListArray.from_arrays(off, pa.array(sp.ans_ids.astype(np.int32))),
                pa.ListArray.from_arrays(off, pa.array(sp.ans_scores.astype(np.float32)))]
    else:
        assert sp.labels is not None
        cols = [strings(sp.ids), strings(sp.img_ids[:, 0]), strings(sp.img_ids[:, 1]), tokens,
                pa.array(sp.labels.astype(np.int8))]
    return pa.Table.from_arrays(cols, schema=split_schema(sp.task, t))


def _list_column(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """list<X> -> (offsets (E + 1,) int64 from 0, flat values)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    o = arr.offsets.to_numpy().astype(np.int64)
    return o - o[0], arr.flatten().to_numpy(zero_copy_only=False)


def table_to_split(table: pa.Table, task: str) -> FinetuneSplit:
    def strings(name: str) -> np.ndarray:
        return np.asarray(table.column(name).to_pylist(), dtype=object)

    tok = table.column("input_ids").combine_chunks()
    input_ids = tok.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    input_ids = input_ids.reshape(len(table), tok.type.list_size)
    if task == "nlvr2":
        return FinetuneSplit(task=task, ids=strings("identifier"),
                             img_ids=np.stack([strings("img0"), strings("img1")], axis=1).reshape(-1, 2),
                             input_ids=input_ids, labels=table.column("label").to_numpy().astype(np.int8))
    offsets, ans = _list_column(table.column("answers"))
    _, scores = _list_column(table.column("scores"))
    return FinetuneSplit(task=task, ids=strings("question_id"), img_ids=strings("img_id"), input_ids=input_ids,
                         ans_offsets=offsets, ans_ids=ans.astype(np.int32, copy=False),
                         ans_scores=scores.astype(np.float32, copy=False))

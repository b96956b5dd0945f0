"""The pretraining kind: a pretraining run's QA head on questions of its store's `minival` split (the
split its evaluations read), their gold answers from the store, with the cross-attention over the boxes.
A run trained without the QA task has no trained head to show: it is refused.
"""

from __future__ import annotations

import numpy as np
import torch

from xmodal.base import run_tags
from xmodal.examples.pictures import META_COLUMNS, picture_of, say_pictures, store_sources
from xmodal.examples.qa import Example, QaRender, answer_example, token_names
from xmodal.examples.run import ExamplesError, Resolved, choose_rows, open_recorded, rows_of

PRETRAIN_SPLIT = "minival"  # the split a pretraining run evaluates
QA_PARAM = "tasks.qa"  # the run's param (its config's key) saying whether it trained the QA task


def trained_qa(config: dict | None, params: dict[str, str]) -> bool | None:
    """Whether the run trained its QA head: its config's `tasks.qa` where known, else its param."""
    tasks = (config or {}).get("tasks")
    if isinstance(tasks, dict) and "qa" in tasks:
        return bool(tasks["qa"])
    said = params.get(QA_PARAM)
    return None if said is None else said.lower() == "true"


class PretrainKind(QaRender):
    name = "pretrain"
    what = "a pretraining run (its QA head)"
    default_split = PRETRAIN_SPLIT

    def open(self, r: Resolved):
        from xmodal.data.lxmert.store import open_store

        return open_recorded(r, run_tags.STORE, "store", open_store)

    def check(self, r: Resolved, store, split: str, config: dict | None = None) -> None:
        """The QA head was trained, and the split is the one its evaluations read."""
        if trained_qa(config, r.run.params) is False:
            raise ExamplesError(f"{r.key}: pretraining run {r.run_id!r} was trained without the QA task "
                                f"({QA_PARAM}=false): its QA head was never trained, so its pages would show an "
                                "untrained head; expected a run trained with tasks.qa=true")
        if split != PRETRAIN_SPLIT or not store.manifest.shards.get(split):
            lacks = "" if store.manifest.shards.get(PRETRAIN_SPLIT) else f", which its store {store.path} lacks"
            raise ExamplesError(f"--split {split}: pretraining run {r.run_id!r} did not evaluate it; its QA head is "
                                f"evaluated on {PRETRAIN_SPLIT}{lacks}")

    def collect(self, model, store, split: str, n: int, notes: list[str], ids: list[str] | None = None,
                config: dict | None = None) -> tuple[list[Example], int]:
        qs = store_questions(store, split)
        if not qs:
            raise ExamplesError(f"{store.path}: split {split!r} holds no questions (sentences with answers) to show")
        rows = choose_rows(len(qs), n) if ids is None else \
            rows_of([q[3] for q in qs], ids, f"{store.path} split {split}", "--compare")
        return evaluate_pretrain(model, store, qs, rows, notes), len(qs)


def store_questions(store, split: str) -> list[tuple[str, int, int, str]]:
    """(shard file, image row in the shard, sentence of the image, question id) of every question of a
    store split (the sentences with answers), reading only the img_id and answer columns."""
    out = []
    for shard in store.manifest.shards.get(split, []):
        t = store.read_table(shard.file, columns=["img_id", "answer_ids"])
        imgs, answers = t.column("img_id").to_pylist(), t.column("answer_ids").to_pylist()
        out += [(shard.file, r, k, f"{imgs[r]}-{k}") for r, sents in enumerate(answers) for k, a in enumerate(sents)
                if a]
    return out


@torch.no_grad()
def evaluate_pretrain(model, store, qs: list[tuple[str, int, int, str]], rows: np.ndarray, notes: list[str]
                      ) -> list[Example]:
    """The pretraining model's QA head on the questions `rows` of `qs`, with its cross-attention: only the
    row groups holding them are read. Right: the prediction is the most-agreed gold answer (`qa_acc`)."""
    from xmodal.data.location import open_parquet
    from xmodal.data.lxmert.rows import table_to_block
    from xmodal.models.lxmert.model import recording_cross_attention

    answers = store.answers()
    sources = store_sources(store)
    model = model.float().eval()
    by_group: dict[tuple[str, int], list[int]] = {}
    starts_of: dict[str, np.ndarray] = {}
    for q in rows.tolist():
        file, r = qs[q][0], qs[q][1]
        if file not in starts_of:
            md = open_parquet(store.path / file).metadata
            starts_of[file] = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
        by_group.setdefault((file, int(np.searchsorted(starts_of[file], r, side="right") - 1)), []).append(q)
    found_examples: dict[int, Example] = {}
    missing: list[str] = []
    for (file, g), group in by_group.items():
        b = table_to_block(store.read_table(file, [g]))
        for q in group:
            _, r, k, qid = qs[q]
            i = r - int(starts_of[file][g])
            si = int(b.sent_offsets[i]) + k
            pic = picture_of(str(b.img_id[i]), {c: getattr(b, c)[i] for c in META_COLUMNS}, store, sources, missing)
            ids = torch.from_numpy(b.input_ids[si:si + 1].astype(np.int64))
            n_obj = b.features.shape[1]
            with recording_cross_attention(model.encoder) as found:
                out = model.encoder(ids, ids != 0, torch.from_numpy(b.features[i:i + 1].astype(np.float32)),
                                    torch.from_numpy(b.boxes[i:i + 1].astype(np.float32)),
                                    torch.from_numpy(np.arange(n_obj)[None] < int(b.num_boxes[i])))
            lo, hi = int(b.ans_offsets[si]), int(b.ans_offsets[si + 1])
            pairs = list(zip(b.ans_ids[lo:hi].tolist(), b.ans_scores[lo:hi].tolist(), strict=True))
            tokens = token_names(store, b.input_ids[si])
            found_examples[q] = answer_example(
                task="pretrain", row=q, id=qid, text=store.tokenizer().decode(b.input_ids[si]), tokens=tokens,
                pictures=[pic], gold=sorted(((answers.answer(int(a)), float(s)) for a, s in pairs), key=lambda t: -t[1]),
                targets={int(a): float(s) for a, s in pairs}, logits=model.qa_head(out.pooled).float()[0],
                names=answers.answer, attention=torch.stack(found).cpu().numpy()[:, :, :, :len(tokens)],
                loss="pretrain")
    examples = [found_examples[q] for q in rows.tolist()]
    say_pictures([e.pictures[0] for e in examples], missing, notes)
    return examples

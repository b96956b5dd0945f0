"""LXMERT ingest from compact arrays: every stored row is what a plain reading of the JSON gives
(records of one image merged across files in reading order, answers normalised with the highest score
kept at the first variant's place, unknown answers and answerless questions counted), and the
per-sentence arrays the ingest keeps are a few bytes a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from refdata import WORDS, write_reference

from xmodal.data.answers import AnswerTable
from xmodal.data.lxmert.ingest import ingest_lxmert

EXTRA = [  # merged into images of the other files; variants of one answer; an unknown answer; {} labels
    {"img_id": "COCO_000003", "sentf": {"gqa": ["what is it?", "Is the dog red?"]},
     "labelf": {"gqa": [{"two": 0.5, "zebra": 1.0, "2": 0.9, "yes": 0.25}, {}]}},
    {"img_id": "COCO_000007", "sentf": {}, "labelf": {}},
    {"img_id": "NOFEAT_1", "sentf": {"mscoco": ["a lonely caption."]}, "labelf": {}},
    {"img_id": "COCO_000011", "sentf": {"vg": ["A man riding a horse, next to the street."]}},
]
MINIVAL = [{"img_id": "COCO_000001", "sentf": {"mscoco": ["a small dog on the table."]}, "labelf": {}},
           {"img_id": "COCO_000020", "sentf": {"vqa": ["is the man sitting?"]},
            "labelf": {"vqa": [{"yes": 1, "no": 0.3}]}}]


def _plain_reading(files: list[Path], table: AnswerTable) -> dict[str, list[tuple[str, dict[int, float] | None]]]:
    """img_id -> [(sentence, {label: best score} or None for a caption)], in reading order."""
    out: dict[str, list] = {}
    for p in files:
        for rec in json.loads(p.read_text()):
            labelf = rec.get("labelf") or {}
            for source, sents in rec["sentf"].items():
                for j, s in enumerate(sents):
                    raw = labelf[source][j] if source in labelf else None
                    best = None
                    if raw is not None:
                        best = {}
                        for a, sc in raw.items():
                            if (k := table.index(a)) is not None:
                                best[k] = max(best.get(k, 0.0), float(np.float32(sc)))
                    out.setdefault(rec["img_id"], []).append((s, best))
    return out


def test_store_rows_equal_a_plain_reading_of_the_json(tmp_path: Path):
    ref = write_reference(tmp_path / "ref", num_images=30, seed=5)
    (tmp_path / "ref" / "extra.json").write_text(json.dumps(EXTRA))
    (tmp_path / "ref" / "mscoco_minival.json").write_text(json.dumps(MINIVAL))
    files = [*ref.json, tmp_path / "ref" / "extra.json", tmp_path / "ref" / "mscoco_minival.json"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", ",", *WORDS,
                                "is", "what", "it", "a"]) + "\n")
    answers = tmp_path / "all_ans.json"  # "zebra", "dog", ... are unknown
    answers.write_text(json.dumps([{"ans": a, "dsets": []} for a in ["yes", "no", "2", "red"]]))
    store = ingest_lxmert(tmp_path / "store", ref.tsv, files, vocab=vocab, answers=answers, progress=False, images_per_shard=8,
                          row_group_images=4, allow_missing_images=True, allow_missing_labelf=True)
    tok, table = store.tokenizer(), store.answers()
    want = _plain_reading(files, table)
    seen = set()
    for split in ("train", "minival"):
        b = store.read_split(split)
        for k, img_id in enumerate(b.img_id):
            seen.add(img_id)
            s0, s1 = b.sent_offsets[k], b.sent_offsets[k + 1]
            np.testing.assert_array_equal(b.input_ids[s0:s1], tok.encode([s for s, _ in want[img_id]])[0])
            for s, (_, best) in zip(range(s0, s1), want[img_id], strict=True):
                a0, a1 = b.ans_offsets[s], b.ans_offsets[s + 1]
                assert b.ans_ids[a0:a1].tolist() == list(best or {}), (img_id, s)  # first variant's place
                assert b.ans_scores[a0:a1].tolist() == list((best or {}).values())
    assert seen == {i for i, sents in want.items() if sents and i != "NOFEAT_1"}
    m = store.manifest
    raws = [a for p in files for r in json.loads(p.read_text()) for labs in (r.get("labelf") or {}).values()
            for lab in labs for a in lab]
    assert m.unknown_answers == sum(a not in table for a in raws) > 0
    assert m.unanswerable_questions >= 1 and m.missing_labelf == 1
    assert m.options["missing_images"] == 1

"""Region features of a researcher's own images: `python jobs/extract.py IMAGES OUT --weights FILE`.

The bottom-up-attention detector (`xmodal.models.butd.detector`, Anderson et al. 2018, as LXMERT's
`data/mscoco_imgfeat/extract_coco_image.py` runs it) over a folder, a list file or an `s3://` prefix
of images, as a Ray Data job, into a feature-only store (kind "features", `xmodal.data.lxmert.features`,
written by `xmodal.data.lxmert.feature_writer`) or the reference's TSV. Its modules, in the order a run
uses them:

- `plan`: every check before Ray starts, each option read once into the `Plan` the rest takes.
- `images`: which images (listing, image ids, `--ids`), and their decoding with OpenCV as the
  reference's `cv2.imread` reads them, with the checks that turn a bad file into a reject.
- `boxes`: `--boxes 36 | MIN-MAX` and `--boxes-from FILE` (given boxes, checked).
- `identity`: each image's size and modification time, what a resumed run checks its inputs by.
- `spec`: how an actor builds its detector.
- `run`: Ray, the cluster's checks (`resources`: actors, GPU share, decode tasks, batch size, the
  hosts' access to the output), the pipeline, the write tasks' records.
- `pipeline`: the Ray Data graph (decode tasks, detector actors, write tasks); the only module here
  importing Ray Data.
- `write`: the write tasks: the detector's output as one shard of store rows or TSV lines.
- `publish`: the commit and the summary.
- `job`: plan, run, publish.
"""

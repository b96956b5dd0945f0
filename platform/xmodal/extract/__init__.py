"""Region features of a researcher's own images: `python jobs/extract.py IMAGES OUT --weights FILE`.

The bottom-up-attention detector (`xmodal.models.butd.detector`, Anderson et al. 2018, as LXMERT's
`data/mscoco_imgfeat/extract_coco_image.py` runs it) over a folder, a list file or an `s3://` prefix
of images, as a Ray Data job, into a feature-only store (kind "features", `xmodal.data.lxmert.features`)
or the reference's TSV. Its rooms:

- `images`: which images (listing, image ids, `--ids`), and their decoding with OpenCV as the
  reference's `cv2.imread` reads them, with the checks that turn a bad file into a reject.
- `boxes`: `--boxes 36 | MIN-MAX` and `--boxes-from FILE` (given boxes, checked).
- `chunks`: the detector's output as store shards or TSV lines, and the resumable work folder
  beside OUT that holds them until the run is published.
- `resources`: the actors, GPU share, decode tasks and batch size a cluster takes (defaults, checks, the
  memory estimate of a batch).
- `pipeline`: the Ray Data graph (decode tasks, detector actors); the only module here importing Ray Data.
- `job`: every check before Ray starts, the run, the publish and the summary.
- `cli`: the command line.
"""

"""Bottom-up-attention region features (Anderson et al., CVPR 2018): the reference's detector as stages.

The reference is the Caffe Faster R-CNN of peteanderson80/bottom-up-attention (ResNet-101 C4,
Visual Genome: 1,600 objects, 400 attributes) as LXMERT runs it in airsplay/lxmert's
`data/mscoco_imgfeat/extract_coco_image.py`. One config tree (`config.DetectorConfig`: input,
backbone, rpn, roi_head, selection, and the "+1" box offset) whose defaults are the reference's
values; one module per stage, each following named reference files:

- `config`: the tree and its defaults, each named once; `DetectOptions`, how one call runs.
- `image`: the input scale, the resized size, the pixel means (`_get_image_blob` in
  `lib/fast_rcnn/test.py`) and OpenCV's generic float32 INTER_LINEAR resize in torch.
- `backbone`: ResNet-101 C4 with Caffe's frozen BatchNorm + Scale, and their folding.
- `anchors`: the RPN's cell anchors and their shifts (`lib/rpn/generate_anchors.py`,
  `lib/rpn/proposal_layer.py`).
- `boxes`: box decoding, clipping, the minimum size, IoU with the "+1" and greedy NMS as `cpu_nms`,
  batched over images with no read back to the host.
- `proposals`: the proposal generator (`RPN`): the RPN head, then the test-time proposal layer over
  each group of images of one input size.
- `roi_heads`: the RoI heads (`RoIHeads`): ROI pooling, res5, the class, box and attribute heads, and
  the selection; or the features of given boxes, with no selection.
- `roi_pool`: Caffe's ROIPooling, 14 x 14 at 1/16, as lookups in a table of block maxima.
- `select`: which proposals become an image's regions: 36 (LXMERT's `extract_coco_image.py`) or
  10 to 100 (the reference's `tools/generate_tsv.py`), with their object and attribute labels.
- `structures`: what the stages hand each other (the image batch, the proposals, the regions, the pass).
- `detector`: `Detector.detect`, the stages called in order over a batch on one device, one copy of
  the final regions to the host; `detect_given_boxes` apart.
- `weights`: the public weight files (airsplay/py-bottom-up-attention's detectron2 pickles,
  MILVLG/bottom-up-attention.pytorch's `.pth`, transformers' `unc-nlp/frcnn-vg-finetuned`) read
  safely into the detector's state dict, with their class, attribute and anchor orders mapped; the
  vocabularies.
"""

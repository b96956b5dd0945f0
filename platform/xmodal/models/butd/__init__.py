"""Bottom-up-attention region features (Anderson et al., CVPR 2018): the reference's detector as stages.

The reference is the Caffe Faster R-CNN of peteanderson80/bottom-up-attention (ResNet-101 C4,
Visual Genome: 1,600 objects, 400 attributes) as LXMERT runs it in airsplay/lxmert's
`data/mscoco_imgfeat/extract_coco_image.py`. One config tree (`config.DetectorConfig`: input,
backbone, rpn, roi_head, selection, and the "+1" box offset) whose defaults are the reference's
values; one module per stage, each following named reference files:

- `config`: the tree and its defaults, each named once.
- `image`: the input scale, the resized size, the pixel means (`_get_image_blob` in
  `lib/fast_rcnn/test.py`) and OpenCV's generic float32 INTER_LINEAR resize in torch.
- `backbone`: ResNet-101 C4 with Caffe's frozen BatchNorm + Scale, and their folding.
- `anchors`: the RPN's cell anchors and their shifts (`lib/rpn/generate_anchors.py`,
  `lib/rpn/proposal_layer.py`).
- `boxes`: box decoding, clipping, the minimum size, IoU with the "+1" and greedy NMS as `cpu_nms`,
  batched over images with no read back to the host.
- `proposals`: the test-time proposal layer over a batch of images of one input size.
- `heads`: the RPN head and the RoI head (res5, class, box and attribute heads).
- `roi_pool`: Caffe's ROIPooling, 14 x 14 at 1/16, as lookups in a table of block maxima.
- `select`: which proposals become an image's regions: 36 (LXMERT's `extract_coco_image.py`) or
  10 to 100 (the reference's `tools/generate_tsv.py`), with their object and attribute labels.
- `detector`: the stages put together; `Detector.detect` over a batch on one device, one copy of the
  final regions to the host.
- `weights`: the public weight files (airsplay/py-bottom-up-attention's detectron2 pickles,
  MILVLG/bottom-up-attention.pytorch's `.pth`, transformers' `unc-nlp/frcnn-vg-finetuned`) read
  safely into the detector's state dict, with their class, attribute and anchor orders mapped; the
  vocabularies.
"""

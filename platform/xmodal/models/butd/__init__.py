"""Bottom-up-attention region features (Anderson et al., CVPR 2018): the reference's conventions.

The reference is the Caffe Faster R-CNN of peteanderson80/bottom-up-attention (ResNet-101 C4,
Visual Genome: 1,600 objects, 400 attributes) as LXMERT runs it in airsplay/lxmert's
`data/mscoco_imgfeat/extract_coco_image.py`. This package holds its conventions as small
torch functions, each module following named reference files:

- `anchors`: the RPN's 12 cell anchors and their shifts over the feature map
  (`lib/rpn/generate_anchors.py`, `lib/rpn/proposal_layer.py`).
- `proposals`: box decoding, clipping, the min-size filter, NMS with "+1" areas and the
  test-time proposal layer (`lib/rpn/proposal_layer.py`, `lib/fast_rcnn/bbox_transform.py`,
  `lib/nms/cpu_nms.pyx`).
- `image`: the input scale, the resized size, the pixel means (`_get_image_blob` in
  `lib/fast_rcnn/test.py`, `lib/fast_rcnn/config.py`) and OpenCV's float32 INTER_LINEAR resize
  as that function calls it (checked against OpenCV 5.1 itself: equal up to float32 rounding).
- `roi_pool`: Caffe's ROIPooling, 14 x 14 at 1/16 (`caffe/src/caffe/layers/roi_pooling_layer.cpp`),
  as a loop (faster on a CPU) and as lookups in a table of block maxima (on a GPU): equal values.
- `frozen_bn`: Caffe's BatchNorm with global stats and Scale, and their folding into a
  per-channel affine map or the convolution before them (`batch_norm_layer.cpp`,
  `scale_layer.cpp`).
- `select`: which proposals become an image's regions: 36 (LXMERT's
  `extract_coco_image.py`) or 10 to 100 (the reference's `tools/generate_tsv.py`), with their
  object and attribute labels.

- `detector`: the network (ResNet-101 C4 with frozen BatchNorm, the RPN, res5 and the class, box
  and attribute heads of `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`) and
  `Detector.extract`, the per-image pipeline above with the RoI head batched across images.

Not reproduced: OpenCV's separate INTER_AREA path for a resize by exactly one half.
"""

"""The file formats the stages hand each other, one owner module per format: it writes,
reads and validates its files, and computes each file's hash once.

- `calib_set`: a calibration set (`calib.jsonl`, `heldout.jsonl`, `manifest.json`),
  written by calibrate, read by quantize, eval, the pipeline and the benchmarks.
- `artifact`: the quantized artifact (a compressed-tensors checkpoint and quantpipe.json):
  its tensors written by quantize and read back into `QuantWeight`s by the runtime loader
  and the kernels build, its KV cache scheme, its identity hash (recorded once, when the
  artifact is sealed) and its manifest.
- `packing`: compressed-tensors' `pack-quantized` int32 words, packed and unpacked for the
  artifact module and the kernels' references.
- `request_log`: the versioned production request-log record, written by the server and
  read by calibrate.
- `report`: eval reports and gate verdicts, read by gate, regression, publish and the pipeline.
- `bigbench`: BIG-bench multiple-choice `task.json` files, read by the eval's multiple-choice
  section and by the lm-eval task files that serve the same items.

These modules import only the standard library, torch, safetensors and `quantpipe.manifest`; every
stage above goes through them.
"""

"""The file formats the stages hand each other, one owner module per format: it writes,
reads and validates its files, and computes each file's hash once.

- `calib_set`: a calibration set (`calib.jsonl`, `heldout.jsonl`, `manifest.json`),
  written by calibrate, read by quantize, eval, the pipeline and the benchmarks.
- `packing`: compressed-tensors' `pack-quantized` int32 words, packed by quantize,
  unpacked by the runtime's artifact reader and the kernels' references.
- `request_log`: the versioned production request-log record, written by the server and
  read by calibrate.
- `report`: eval reports and gate verdicts, read by gate, regression, publish and the pipeline.

These modules import only the standard library, torch and `quantpipe.manifest`; every
stage above goes through them.
"""

"""Stage 2: weights onto INT8 / INT4 grids, written as compressed-tensors artifacts.

    from quantpipe.quantize import QuantConfig, quantize
    art = quantize(None, QuantConfig(scheme="W4A16", group_size=64, method="gptq"), "calib_sets/sample-set",
                   "artifacts/smollm2-w4a16-g64")

Files: config.py (QuantConfig), rtn.py (grids, round-to-nearest), gptq.py, pack.py
(compressed-tensors packing), stage.py (the run and the artifact), cli.py.
The runtime loads artifacts (runtime/model/compressed.py, runtime/model/quantized.py).
"""

from quantpipe.quantize.config import QuantConfig
from quantpipe.quantize.stage import Artifact, artifact_sha256, quantize

__all__ = ["Artifact", "QuantConfig", "artifact_sha256", "quantize"]

"""quantpipe: calibrate on production traffic, quantize, verify, gate and publish LLMs.

Stages live in their own subpackages; the runtime that serves and evaluates models is
`quantpipe.runtime` (source folder `runtime/`), kernels are `quantpipe.kernels`
(`kernels/src/`), eval suites and gates `quantpipe.evals` (`evals/`).
"""

__version__ = "0.2.0"

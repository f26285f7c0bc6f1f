"""Stage 1: calibration and held-out sets sampled from production request logs.

    from quantpipe.calibrate import CalibConfig, calibrate
    calib = calibrate(CalibConfig(logs=["logs/*.jsonl.gz"], strata=["metadata.task", "length"], out="calib_sets/prod"))

Files: config.py (the recipe), sources.py (log formats), clean.py (PII, duplicates),
strata.py (strata, allocation, clusters), stage.py (the two passes), report.py (coverage.html),
cli.py (`quantpipe calibrate`).
"""

from quantpipe.calibrate.config import CalibConfig
from quantpipe.calibrate.stage import calibrate
from quantpipe.formats.calib_set import CalibSet

__all__ = ["CalibConfig", "CalibSet", "calibrate"]

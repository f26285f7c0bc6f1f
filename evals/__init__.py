"""Data only: eval suites, gate and canary policies, pipeline recipes, CI baselines and the
multiple-choice task files. The metric code that reads them is `quantpipe.eval`."""

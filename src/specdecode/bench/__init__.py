"""The benchmark: every method side by side on the same prompts, in the same run, against
transformers and against the physical limit of the machine (``specdecode bench``).

:mod:`.workloads` the prompts, :mod:`.runners` the methods (the registry's and the peers'),
:mod:`.run` the interleaved run and its records, :mod:`.report` the tables and the chart.
"""

"""Studies: one module per study with the logic its notebook calls, and the notebook runner.

``run_study(N, preset)`` executes ``nbs/NN_*.ipynb`` with papermill into ``studies/NN_name/`` under
one MLflow parent run. Inside the notebook, every ``moelab.train.fit`` call and every
``nested_run(...)`` block becomes a child run of that parent.
"""

from moelab.studies.runner import STUDIES, default_preset, find_notebook, nested_run, run_study
from moelab.tracking import current_parent_run_id

__all__ = ["STUDIES", "current_parent_run_id", "default_preset", "find_notebook", "nested_run", "run_study"]

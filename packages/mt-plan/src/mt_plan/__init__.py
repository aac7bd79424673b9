"""mt-plan: parallel-layout search over a calibrated cost model.

Importing this package, the cost model and the search imports no torch: only
:mod:`mt_plan.models` (mt-train's configs), :mod:`mt_plan.measure` (calibration) and pipeline
timings (mt-parallel's simulator, on first use) do.
"""

from mt_plan.calibration import CalibrationTable, load_table
from mt_plan.cluster import Cluster, ClusterError, load_cluster
from mt_plan.cost import CostModel, Estimate, Workload
from mt_plan.layout import Layout, layout_problem
from mt_plan.search import SearchResult, SearchSpace, search
from mt_plan.shape import ModelShape

__version__ = "0.1.0"

__all__ = [
    "CalibrationTable",
    "Cluster",
    "ClusterError",
    "CostModel",
    "Estimate",
    "Layout",
    "ModelShape",
    "SearchResult",
    "SearchSpace",
    "Workload",
    "__version__",
    "layout_problem",
    "load_cluster",
    "load_table",
    "search",
]

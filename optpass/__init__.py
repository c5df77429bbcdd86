"""optpass: a torch.compile backend that rewrites whole training steps.

    step = torch.compile(train_step, backend="optpass", options={...})
    print(optpass.explain(train_step, x, y))

See README.md for the supported step shape, the options and the passes.
"""

from optpass.backend import optpass_backend
from optpass.capture import (BackwardOutsideGraphWarning, GraphKind, OptimizerStepInLoopWarning,
                             RecompilingUpdateWarning, RecurrentLayerFallbackWarning)
from optpass.runtime.gradient_clearing import GradientsNeverClearedWarning
from optpass.errors import OptpassError
from optpass.explain import Explanation, explain
from optpass.options import options_help
from optpass.passes import PASSES
from optpass.report import keep_graphs, recent_reports
from optpass.step import StepGraph

__version__ = "0.1.0"

_LAZY = {"graph_diff": "optpass.analysis.diff", "graph_text": "optpass.analysis.diff",
         "estimate_peak_memory": "optpass.analysis.memory", "MemoryEstimate": "optpass.analysis.memory",
         "measure_tensor_peak": "optpass.analysis.memory", "MeasuredPeak": "optpass.analysis.memory", "MemoryMeasurementWarning": "optpass.analysis.memory",
         "save_sharded_checkpoint": "optpass.fsdp.checkpoint", "load_sharded_checkpoint": "optpass.fsdp.checkpoint",
         "fully_shard": "optpass.fsdp.shard", "RanksSeededDifferentlyWarning": "optpass.fsdp.materialize", "full_state_dict": "optpass.fsdp.checkpoint",
         "load_full_state_dict": "optpass.fsdp.checkpoint",
         "optimizer_state_dict": "optpass.zero1.checkpoint",
         "pad_batch": "optpass.dpsgd", "DPSGDModelWarning": "optpass.dp_model_checks", "bucket_size": "optpass.dpsgd",
         "master_weights": "optpass.precision.masters", "skipped_steps": "optpass.precision.grad_scaler",
         "grad_norm": "optpass.runtime.grad_norm"}


def __getattr__(name):
    # Names of the tools, checkpoints and DP-SGD helpers: their modules load on first use.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in ("zero1", "fsdp", "plans"):                  # a submodule, loaded on first use
        return importlib.import_module(f"optpass.{name}")
    raise AttributeError(f"module 'optpass' has no attribute {name!r}")
__all__ = [
    "optpass_backend", "explain", "Explanation", "graph_diff", "graph_text",
    "estimate_peak_memory", "MemoryEstimate", "measure_tensor_peak", "MeasuredPeak", "MemoryMeasurementWarning", "OptpassError", "BackwardOutsideGraphWarning", "RecompilingUpdateWarning",
    "RecurrentLayerFallbackWarning", "OptimizerStepInLoopWarning", "GradientsNeverClearedWarning",
    "RanksSeededDifferentlyWarning", "DPSGDModelWarning",
    "GraphKind", "StepGraph", "PASSES", "options_help", "keep_graphs", "recent_reports",
    "save_sharded_checkpoint", "load_sharded_checkpoint", "optimizer_state_dict", "pad_batch", "bucket_size",
    "master_weights", "skipped_steps", "grad_norm", "fully_shard", "full_state_dict", "load_full_state_dict",
]

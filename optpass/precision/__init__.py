"""Mixed precision outside the step graph: fp32 master weights (``masters``) and a GradScaler's
state and skip count (``grad_scaler``)."""

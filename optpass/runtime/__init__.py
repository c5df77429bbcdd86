"""The callables that run a step whose update is fused into its graph (Dynamo calls them in place
of the step graph): ``fused_step`` (the base, torch.optim's update inside or after backward),
``sharded_step`` (data_parallel='zero1'), ``master_weights_step`` (fp32 masters), and
``scaled_micro_step`` (a micro-step of gradient accumulation under a grad_scaler)."""

"""optpass.integrations.transformers: a Hugging Face Trainer run with its step compiled by optpass
equals the same run without optpass, through accumulation windows (one cut short at each epoch's
end), clipping, a cosine warmup from lr 0, gradient checkpointing, a checkpoint and a resume in a
new process; what a compiled step cannot take in is refused when the Trainer is built.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import optpass  # noqa: E402
from hf_trainer_program import arguments, dataset, tiny_llama, trainer  # noqa: E402
from optpass.integrations.transformers import OptpassTrainer  # noqa: E402

TOL = 1e-9


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _logged(run) -> list[tuple]:
    return [(h["loss"], h.get("grad_norm"), h["learning_rate"]) for h in run.state.log_history if "loss" in h]


def test_a_trainer_run_with_its_step_compiled_by_optpass_equals_the_trainers_own(tmp_path, float64_default):
    base = tiny_llama()
    eager_model, optpass_model = copy.deepcopy(base), copy.deepcopy(base)
    eager = trainer(transformers.Trainer, eager_model, str(tmp_path / "eager"), optpass=False)
    eager.train()
    compiled = trainer(OptpassTrainer, optpass_model, str(tmp_path / "optpass"), optpass=True,
                       save_strategy="steps", save_steps=3)
    compiled.train()

    assert compiled.state.global_step == eager.state.global_step == 8     # 2 epochs of 4 windows
    assert _max_rel_diff(_params(optpass_model), _params(eager_model)) <= TOL
    logged, expected = _logged(compiled), _logged(eager)
    assert len(logged) == len(expected) == 8
    for (loss, norm, lr), (eager_loss, eager_norm, eager_lr) in zip(logged, expected):
        assert loss == pytest.approx(eager_loss, rel=TOL) and lr == eager_lr
        assert norm == pytest.approx(eager_norm, rel=TOL) and eager_norm > 0.3      # every update clipped
    assert expected[0][2] == 0.0                                                    # the warmup starts at lr 0
    state = compiled.raw_optimizer.state_dict()["state"]
    eager_state = eager.optimizer.state_dict()["state"]
    assert max(((state[k]["exp_avg_sq"] - eager_state[k]["exp_avg_sq"]).abs().max()
                / eager_state[k]["exp_avg_sq"].abs().max()).item() for k in eager_state) <= TOL
    # the update ran inside the compiled backward (the windows cut short were stepped eagerly)
    assert any(p.name == "optimizer_in_backward" and p.status == "applied"
               for r in optpass.recent_reports() for p in r.passes)
    assert any(p.name == "clip_grad_norm_in_backward" and p.status == "applied"
               for r in optpass.recent_reports() for p in r.passes)

    # a resume in a new process from the checkpoint of step 3 (mid-epoch) ends where the run ended
    out = tmp_path / "resumed.pt"
    program = os.path.join(os.path.dirname(__file__), "hf_trainer_program.py")
    result = subprocess.run([sys.executable, program, "--dir", str(tmp_path / "resumed"),
                             "--resume", str(tmp_path / "optpass" / "checkpoint-3"), "--out", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = torch.load(out)
    assert resumed["global_step"] == 8
    assert _max_rel_diff(resumed["params"], _params(optpass_model)) <= 1e-12
    resumed_state = resumed["optimizer"]["state"]
    assert all(torch.equal(resumed_state[k]["step"], state[k]["step"]) for k in state)


def test_without_clipping_the_trainer_still_logs_the_gradient_norm(tmp_path, float64_default):
    """max_grad_norm=0: no clipping, but the Trainer logs clip_grad_norm_(params, inf) every step;
    OptpassTrainer asks for clip_grad_norm=inf, which reports that norm without a second backward."""
    base = tiny_llama()
    runs = {}
    for cls, optpass_run in ((transformers.Trainer, False), (OptpassTrainer, True)):
        model = copy.deepcopy(base)
        run = trainer(cls, model, str(tmp_path / cls.__name__), optpass=optpass_run, max_grad_norm=0.0,
                      gradient_accumulation_steps=1, num_train_epochs=1, gradient_checkpointing=False)
        run.train()
        runs[optpass_run] = (_logged(run), _params(model))
    (logged, params), (expected, eager_params) = runs[True], runs[False]
    assert len(logged) == len(expected) == 14
    for (loss, norm, _), (eager_loss, eager_norm, _) in zip(logged, expected):
        assert norm is not None and norm == pytest.approx(eager_norm, rel=TOL)
    assert _max_rel_diff(params, eager_params) <= TOL


@pytest.mark.parametrize("setting, message", [
    ({"fp16": True}, "fp16=True: the Trainer scales the loss with a GradScaler"),
    ({"torch_compile": True}, "torch_compile=True: the Trainer would compile the model's forward again"),
    ({"optim": "lomo"}, "LOMO updates inside its own backward"),
])
def test_what_a_compiled_step_cannot_take_in_is_refused_with_the_way_that_works(tmp_path, setting, message):
    try:
        args = arguments(str(tmp_path), **setting)
    except (ValueError, ImportError) as error:          # this transformers refuses the setting on CPU itself
        pytest.skip(f"TrainingArguments({setting}) is refused here: {error}")
    with pytest.raises(optpass.OptpassError, match="OptpassTrainer cannot compile") as info:
        OptpassTrainer(model=tiny_llama(), args=args, train_dataset=dataset())
    assert message in str(info.value)


def test_the_optimizer_is_always_the_trainers(tmp_path):
    with pytest.raises(optpass.OptpassError, match="the optimizer is the Trainer's"):
        OptpassTrainer(model=tiny_llama(), args=arguments(str(tmp_path)), train_dataset=dataset(),
                       optpass_options={"optimizer": torch.optim.SGD([torch.zeros(1, requires_grad=True)])})

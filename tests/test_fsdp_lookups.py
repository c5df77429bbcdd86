"""reshard_after_forward under Inductor: a lookup in a gathered parameter (an embedding) is a buffer of
its own, so the gathered parameter dies after forward. Measured in one fresh process (a one-rank gloo
group): torch.profiler's memory events, which measure_tensor_peak reads, miss the frees gloo's threads
make on several ranks; and in a test worker that had run other files before it, the measured peak with
and without the copy came out equal once (not explained: docs/fsdp.md), so the measurement runs in a
process of its own. Training on 2 ranks: tests/test_fsdp.py (lookups_materialized)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _growths() -> dict:
    """The step's live-tensor growth with and without the lookup's copy (this process)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import optpass
    from fsdp_workers import _EmbeddingModel, adamw, make_step, reshard_settings

    def cross_entropy(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    growth = {}
    for materialize in (True, False):
        with reshard_settings(MATERIALIZE_LOOKUPS=materialize):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = _EmbeddingModel()
            optpass.fully_shard(model)
            opt = adamw(model)
            step = torch.compile(make_step(model, opt, cross_entropy), backend="optpass",
                                 options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True})
            tokens = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(0))
            for _ in range(2):
                step(tokens[:, :-1], tokens[:, 1:])
            with optpass.measure_tensor_peak() as peak:
                step(tokens[:, :-1], tokens[:, 1:])
            growth[str(materialize)] = peak.growth_bytes
    dist.destroy_process_group()
    return growth


def test_the_gathered_embedding_dies_after_its_lookup():
    """The model reads the looked-up rows in a norm, a residual add and the norm's backward. Left to
    Inductor, each of those kernels looks the rows up again in the gathered embedding, which lives
    until the norm's backward, beside the head's gradient; made a buffer, it dies after the lookup:
    the step's live peak is lower by the embedding's bytes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    embedding_bytes = 4096 * 64 * 8
    assert growth["False"] - growth["True"] >= 0.9 * embedding_bytes, (growth, embedding_bytes)


if __name__ == "__main__":
    print(json.dumps(_growths()))

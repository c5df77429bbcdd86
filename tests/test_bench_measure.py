"""bench/_measure.py, the harness every bench uses.

Its live-tensor peak counts exactly the bytes of the tensors alive at once, frees on other threads
included (the counting CPU allocator stays installed for the rest of its process, so the toy runs in
a fresh process). Its children get the environment it gives them and come back as their result, a
failure or a timeout as a ChildError; its ranks meet on a free port. The children are this file,
run as a script (see the end).
"""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _load_measure():
    spec = importlib.util.spec_from_file_location("_measure", BENCH / "_measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


measure = _load_measure()


def test_live_tensor_peak_is_exact():
    out = subprocess.run([sys.executable, __file__, "toy"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(BENCH)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == "ok"


def _toy() -> None:
    import threading

    import torch
    from _measure import CPUTensorBytes

    n, m, base = 8 << 20, 5 << 20, 1 << 20
    before = torch.ones(1 << 18)                 # alive before start(): not counted, nor its free
    live = CPUTensorBytes()
    live.start()
    kept = torch.empty(base, dtype=torch.uint8)
    x = torch.ones(4)
    for _ in range(100):                         # many small allocations and frees
        x = x + 1
    del x
    with live.mark("one"):
        a = torch.empty(n, dtype=torch.uint8)
        del a
    with live.mark("two"):
        b, c = torch.empty(m, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)
        del b, c
    del before
    # a tensor that dies on another thread (as gloo's workers free a collective's buffers)
    box = [torch.empty(m, dtype=torch.uint8)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    with live.mark("three"):
        d = torch.empty(m // 2, dtype=torch.uint8)
        del d
    result = live.stop()
    assert result["peak_bytes"] == max(n, 2 * m) + base, result
    # which tensors were alive at the run's peak: those of "two" (`kept` is older than the mark)
    assert result["peak_in"] == "two" and result["alive_at_peak"] == [m, m], result
    assert result["marks"]["one"] == {"peak_bytes": n + base, "end_bytes": base}
    assert result["marks"]["two"] == {"peak_bytes": 2 * m + base, "end_bytes": base}
    assert result["marks"]["three"] == {"peak_bytes": m // 2 + base, "end_bytes": base}, result
    assert result["end_bytes"] == base
    assert kept.numel() == base


def _env(**extra) -> dict:
    """What a bench gives its children, plus PYTHONPATH for this file's imports of _measure."""
    return measure.child_env(3, "/tmp/a-cache-dir", PYTHONPATH=str(BENCH), **extra)


def test_child_command_spells_every_flag_as_argparse_reads_it():
    cmd = measure.child_command("bench/x.py", child="optpass/sgd", d_model=64, bucket_bytes=None,
                                estimate=True, no_tensor_peak=False, model=json.dumps({"a": 1}))
    assert cmd == [sys.executable, os.path.abspath("bench/x.py"), "--child", "optpass/sgd", "--d-model", "64",
                   "--estimate", "--model", '{"a": 1}']


def test_a_child_gets_its_environment_and_comes_back_as_its_result(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")          # a debug variable of the parent: never passed on
    monkeypatch.setenv("OPTPASS_BENCH_KEPT", "yes")       # anything else: passed on
    result = measure.run_child(measure.child_command(__file__, mode="env"), _env(MALLOC_MMAP_THRESHOLD_=131072,
                                                                              TRITON_CACHE_DIR=None), timeout=120)
    env = result.pop("env")
    assert env == {"OMP_NUM_THREADS": "3", "TORCHINDUCTOR_CACHE_DIR": "/tmp/a-cache-dir",
                   "MALLOC_MMAP_THRESHOLD_": "131072", "OPTPASS_BENCH_KEPT": "yes"}
    assert set(result) == {"process_wall_s", "process_cpu_s", "other_processes_cores", "stderr_warnings"}
    assert result["stderr_warnings"] == ["UserWarning: a warning on stderr"]
    assert 0 < result["process_wall_s"] < 120 and result["process_cpu_s"] >= 0


def test_a_child_that_fails_or_prints_no_result_or_hangs_is_a_child_error():
    with pytest.raises(measure.ChildError) as failed:
        measure.run_child(measure.child_command(__file__, mode="fail"), _env(), timeout=120)
    assert failed.value.returncode == 3 and not failed.value.timed_out
    assert "child failed (exit 3)" in str(failed.value) and "the child's last words" in failed.value.stderr
    assert isinstance(failed.value, SystemExit)           # not caught, it ends the bench with its message

    with pytest.raises(measure.ChildError, match=r"child failed \(exit 0\)"):
        measure.run_child([sys.executable, "-c", "print('no result')"], timeout=120)

    started = time.perf_counter()
    with pytest.raises(measure.ChildError) as hung:
        measure.run_child(measure.child_command(__file__, mode="sleep"), _env(), timeout=2)
    assert hung.value.timed_out and "timed out after 2s" in str(hung.value)
    assert time.perf_counter() - started < 60             # killed at the timeout, not waited for


def test_ranks_meet_on_a_free_port_and_come_back_by_rank():
    results = measure.run_ranks(measure.child_command(__file__, mode="rank", world=2), 2, _env(), timeout=300)
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_when_one_rank_fails_the_others_are_killed_and_its_output_is_shown():
    started = time.perf_counter()
    with pytest.raises(measure.ChildError) as failed:
        measure.run_ranks(measure.child_command(__file__, mode="rank", world=2, fail_rank=1), 2, _env(), timeout=300)
    assert "--rank 1" in str(failed.value) and "rank 1 gives up" in failed.value.stderr
    assert time.perf_counter() - started < 120            # rank 0 did not wait for its group's timeout


def test_free_port_can_be_listened_on():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", measure.free_port()))


def test_training_step_is_the_supported_step_and_graph_count_counts_compiles():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    before = measure.graph_count()
    step = torch.compile(measure.training_step(lambda x, y: torch.nn.functional.mse_loss(model(x), y), opt),
                         backend="eager")
    out = step(x, y)
    assert measure.graph_count() > before
    loss = torch.nn.functional.mse_loss(reference(x), y)
    loss.backward()
    ref_opt.step()
    assert not out.requires_grad and torch.allclose(out, loss.detach())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_print_json_prints_the_brief_and_writes_the_whole(tmp_path, capsys):
    path = tmp_path / "out.json"
    measure.print_json({"a": 1}, {"a": 1, "raw": [2]}, str(path), indent=1)
    assert capsys.readouterr().out == 'JSON: {"a": 1}\n'
    assert json.loads(path.read_text()) == {"a": 1, "raw": [2]}


def test_memory_cap_ends_a_child_soon_after_its_peak_rss_passes_the_cap(tmp_path):
    report = tmp_path / "over_cap.json"
    started = time.perf_counter()
    with pytest.raises(measure.ChildError) as ended:
        measure.run_child(measure.child_command(__file__, mode="cap", report=str(report)), _env(), timeout=120)
    assert ended.value.returncode == measure.OVER_CAP_EXIT, ended.value.stderr
    assert "64 MiB under the cap: kept" in ended.value.stdout and "grew past" not in ended.value.stdout
    over = json.loads(report.read_text())
    assert over["phase"] == "growing" and over["rss_bytes"] > over["cap_bytes"] and over["blocks"] > 1
    assert over["rss_bytes"] < over["cap_bytes"] + (256 << 20)      # ended on the way to 1 GiB more
    assert time.perf_counter() - started < 60


def _child(argv) -> None:
    """The children of the tests above, as a bench's children are: flags in, emit_result out."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--report")
    from _measure import MemoryCap, add_rank_flags, emit_result, init_gloo, proc_status_kib

    add_rank_flags(p)
    args = p.parse_args(argv)

    if args.mode == "env":
        print("UserWarning: a warning on stderr", file=sys.stderr)
        names = ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "MALLOC_MMAP_THRESHOLD_", "TRITON_CACHE_DIR",
                 "TORCH_LOGS", "OPTPASS_BENCH_KEPT")
        emit_result({"env": {k: os.environ[k] for k in names if k in os.environ}})
    elif args.mode == "fail":
        print("the child's last words", file=sys.stderr)
        sys.exit(3)
    elif args.mode == "sleep":
        time.sleep(600)
    elif args.mode == "cap":
        kept = [b"x" * (64 << 20)]                # written, so resident: under the cap
        cap = MemoryCap(proc_status_kib("VmHWM") * 1024 + (64 << 20), args.report,
                        details=lambda: {"blocks": len(kept)}).start()
        time.sleep(0.3)
        print("64 MiB under the cap: kept", flush=True)
        cap.phase = "growing"
        for _ in range(64):                       # 1 GiB more, 16 MiB at a time
            kept.append(b"x" * (16 << 20))
            time.sleep(0.01)
        print(f"grew past the cap: {len(kept)} blocks", flush=True)
    elif args.mode == "rank":
        if args.rank == args.fail_rank:
            sys.exit(f"rank {args.rank} gives up")
        import torch
        import torch.distributed as dist

        init_gloo(args.rank, args.world, args.port, timeout_s=600)
        total = torch.tensor([args.rank + 1.0])
        dist.all_reduce(total)
        dist.destroy_process_group()
        emit_result({"rank": args.rank, "world": args.world, "sum": total.item()})


if __name__ == "__main__":
    if sys.argv[1:] == ["toy"]:
        _toy()
        print(json.dumps("ok"))
    else:
        _child(sys.argv[1:])

"""The benchmark harness runs end to end in --quick mode and every method it runs is correct.

Nothing about time is asserted: timings live in benchmarks/README.md, not in tests.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name> <args>`` with this interpreter, its output captured (the timeout only stops a
    hang: a busy machine takes many times a quiet one's few minutes)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True, timeout=timeout
    )


# torch 2.13's vmap of LayerNorm's backward is wrong under a second differentiation
# (pytorch/functorch#534): torch.func's own penalty step is wrong on the workload with LayerNorm
TORCH_FUNC_WRONG = {("seq", "torch_func_penalty")}


def test_quick_benchmark_runs_and_every_method_is_correct(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    proc = run_script("bench.py", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"mlp", "cnn", "seq", "resnet"}
    for workload, methods in report["results"].items():
        assert {
            "plain",
            "pergrad_hooks",
            "torch_func",
            "pergrad",
            "pergrad_norms",
            "pergrad_clip",
            "pergrad_stats",
            "pergrad_stats_trace",
            "torch_func_penalty",
            "pergrad_penalty",
            "pergrad_penalty_norms",
            "torch_func_project",
            "pergrad_project_kron",
            "pergrad_project_dense",
        } <= set(methods)
        for method, result in methods.items():
            expected = (workload, method) not in TORCH_FUNC_WRONG
            assert result.get("correct") is expected, (workload, method, result)
            if method.endswith("penalty") or method.endswith("penalty_norms"):
                assert result["checked"] == "penalty_grad", (workload, method, result)
            assert result["page_faults_per_step"] >= 0, (workload, method, result)
            if "project" in method:
                assert result["checked"] == "projection", (workload, method, result)
                assert result["max_rel_err"] < 1e-3, (workload, method, result)
    assert "| pergrad |" in proc.stdout
    assert "| pergrad_penalty_norms |" in proc.stdout
    assert "| pergrad_project_kron |" in proc.stdout
    assert "peak allocated memory" in proc.stdout  # glibc: the CPU's allocated-memory table
    assert proc.stdout.startswith("device: cpu (") and report["device"].startswith("cpu (")


def test_the_penalty_check_tells_a_full_gradient_from_the_loss_gradient_alone() -> None:
    """The check of a penalty step compares against the gradient of ``mean_i f_i + lam * mean_i
    ||g_i||^2``: the loss's gradient alone (a penalty that silently did nothing) fails it, and so does
    a penalty term off by BackPACK's 1/B; pergrad's full gradient after three steps, on each of
    three batch sizes, passes it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench

    for b in (16, 5, 9):
        model, x, y = bench.build("mlp", quick=True, batch=b)
        reference = copy.deepcopy(model)
        step, result = bench.setup("pergrad_penalty", model, x, y)
        for _ in range(3):
            step()
        kind, got = result()
        assert kind == "penalty_grad"
        assert bench.check(kind, dict(got), reference, x, y)[0], b

        loss_only = copy.deepcopy(reference)
        torch.nn.functional.cross_entropy(loss_only(x), y).backward()
        plain = {n: p.grad for n, p in loss_only.named_parameters()}
        assert not bench.check(kind, plain, reference, x, y)[0], b
        penalty_part = {n: got[n] - plain[n] for n in got}
        off_by_b = {n: plain[n] + penalty_part[n] / b for n in got}
        assert not bench.check(kind, off_by_b, reference, x, y)[0], b


@pytest.mark.parametrize("kind", ["kron", "dense"])
def test_the_projection_check_tells_exact_features_from_wrong_ones(kind: str) -> None:
    """The check of a projection row compares a method's features with its own ``P`` applied to
    torch.func's float64 per-sample gradients: pergrad's features after each of three training steps,
    on batches of three sizes, pass it; features of another seed, with two samples swapped, of the
    mean loss's gradient (``g_i / B``) or of the model before the last update fail it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench

    for b in (16, 5, 9):
        model, x, y = bench.build("mlp", quick=True, batch=b)
        reference = copy.deepcopy(model)  # the same weights, without pergrad's hooks
        step, result = bench.setup(f"pergrad_project_{kind}", model, x, y)
        right = bench.pergrad_projectors(reference, kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            step()
            found, got = result()
            assert found == "projection"
            features = got["features"]
            assert tuple(features.shape) == (b, bench.PROJECT_DIM)
            ok, worst, _ = bench.check(found, dict(got), reference, x, y)
            assert ok and worst < 1e-5, (b, worst)
            per_sample = bench.per_sample_reference64(reference, x, y)
            expected = right(per_sample)  # drawn once: the wrong features below are checked against it

            def same(_: object, expected: torch.Tensor = expected) -> torch.Tensor:
                return expected

            other_seed = bench.pergrad_projectors(reference, kind, seed=bench.PROJECT_SEED + 1)(per_sample)
            swapped = features.clone()
            swapped[[0, 1]] = features[[1, 0]]
            for wrong in (other_seed.float(), swapped, features / b):
                assert not bench.check(found, {"features": wrong, "_project": same}, reference, x, y)[0], b
            optimizer.step()
            reference.load_state_dict(model.state_dict())
            stale = bench.check(found, {"features": features, "_project": right}, reference, x, y)
            assert not stale[0], b


def test_what_pergrad_holds_between_steps(tmp_path: Path) -> None:
    """``benchmarks/held.py``: after three steps, hooks alone hold nothing (the first backward's
    check built per-sample tensors; they are released), materialising holds ``grad_sample`` alone
    (no scaled copies of output gradients), fused clipping a small part of it; and the graph of the
    last step, kept after its backward, holds no more than plain autograd's (no layer input)."""
    out = tmp_path / "held.json"
    proc = run_script("held.py", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for workload, held in json.loads(out.read_text()).items():
        assert held["hooks"] == 0, workload
        assert held["analytic"] <= held["materialise"] <= 1.1 * held["analytic"], (workload, held)
        assert held["clip"] <= 0.5 * held["analytic"], (workload, held)
        for mode in ["hooks", "materialise", "clip", "norms", "stats"]:
            assert held[f"{mode} graph"] <= held["plain graph"], (workload, mode, held)


def test_the_benchmark_refuses_a_device_it_does_not_have() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = run_script("bench.py", "--quick", "--device", "cuda")
    assert proc.returncode == 2
    assert "--device 'cuda': no CUDA device is available here" in proc.stderr


def test_quick_distributed_benchmark_runs_and_pergrad_sends_what_plain_sends(tmp_path: Path) -> None:
    out = tmp_path / "distributed.json"
    proc = run_script("distributed.py", "--quick", "--workloads", "mlp", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    methods = json.loads(out.read_text())["results"]["mlp"]
    assert all("error" not in r for r in methods.values()), methods
    assert methods["ddp_plain"]["bytes"] == methods["ddp_pergrad"]["bytes"] == methods["ddp_pergrad_keep"]["bytes"]
    assert methods["ddp_plain"]["bytes"] == methods["ddp_plain"]["gradient_bytes"]
    assert methods["fsdp_plain"]["bytes"] == methods["fsdp_pergrad"]["bytes"] > 0
    assert "| ddp_pergrad |" in proc.stdout


def test_quick_transformer_workloads_are_correct(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "transformers.json"
    proc = run_script(
        "bench.py", "--quick", "--workloads", "gpt2", "bert", "--methods", "plain", "pergrad", "pergrad_clip",
        "--batch", "3", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for workload in ("gpt2", "bert"):
        for method in ("plain", "pergrad", "pergrad_clip"):
            result = report["results"][workload][method]
            assert result.get("correct") is True and result["batch"] == 3, (workload, method, result)


def test_quick_memory_benchmark_runs_and_stays_within_one_step(tmp_path: Path) -> None:
    """benchmarks/memory.py end to end on tiny shapes: after every one of its steps of changing
    batch sizes and lengths, pergrad holds no more than one step of the largest shape seen."""
    out = tmp_path / "memory.json"
    proc = run_script(
        "memory.py", "--quick", "--rows", "poisson_mlp", "lengths_seq", "--no-plain", "--speed", "mlp_fused",
        "--threads", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["memory"]["current"]
    assert set(rows) == {"poisson_mlp", "lengths_seq"}
    for row in ("poisson_mlp", "lengths_seq"):
        result = rows[row]
        assert result["pergrad"] == str(ROOT / "pergrad" / "__init__.py")
        assert len({tuple(s) for s in result["shapes"]}) > 3, "the shapes change between steps"
        assert 0 < max(result["held_mib"]) <= result["one_step_mib"], (row, result["held_mib"])
    assert report["speed"]["rows"]["mlp_fused"]["current_ms"] > 0
    assert "| poisson_mlp | 12 |" in proc.stdout


PEER_ROWS = {
    "trak": ["trak_project"],
    "dattri": ["dattri_trak", "dattri_tracin"],
    "logix": ["logix_logra"],
}


@pytest.mark.parametrize("peer", sorted(PEER_ROWS))
def test_quick_projection_peers_are_correct_where_installed(peer: str, tmp_path: Path) -> None:
    """The attribution peers' rows, where the peer is installed (never in CI): each one's features
    equal its own projection of torch.func's per-sample gradients."""
    pytest.importorskip(peer)
    out = tmp_path / f"{peer}.json"
    methods = ["plain", "pergrad_project_kron", *PEER_ROWS[peer]]
    proc = run_script("bench.py", "--quick", "--workloads", "mlp", "cnn", "--methods", *methods, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for workload, found in json.loads(out.read_text())["results"].items():
        for method in methods:
            assert found[method].get("correct") is True, (workload, method, found[method])


def test_quick_scoring_benchmark_is_correct_and_bounded(tmp_path: Path) -> None:
    """benchmarks/scoring.py end to end on tiny shapes: every chunk size's top-k equals torch.topk of
    the exact scores, and the table and JSON are written."""
    out = tmp_path / "scoring.json"
    proc = run_script("scoring.py", "--quick", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["chunk"] for r in report["runs"]] == [128, 512]
    for r in report["runs"]:
        assert r.get("correct") is True, r
        assert r["checked_test_samples"] == 64
    assert "| chunk | time (s) |" in proc.stdout


def test_interleaved_saves_a_row_per_workload_and_method(tmp_path: Path) -> None:
    """(With glibc told to keep freed memory, as ``--keep-freed-memory`` does for bench.py's children.)"""
    out = tmp_path / "interleaved.json"
    methods = ["plain", "pergrad_hooks", "pergrad_features_kron"]
    proc = run_script(
        "interleaved.py", "--workloads", "mlp", "--rounds", "2", "--methods", *methods, "--json", str(out),
        "--keep-freed-memory",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python benchmarks/interleaved.py --workloads mlp")
    assert [(r["workload"], r["method"]) for r in report["rows"]] == [("mlp", m) for m in methods]
    plain = report["rows"][0]
    assert plain["ratio_min"] == 1.0 and plain["ratio_min_cpu"] == 1.0
    assert all(r["min_ms"] > 0 and r["median_ms"] >= r["min_ms"] for r in report["rows"])


def test_quick_conv_paths_agree_and_are_saved(tmp_path: Path) -> None:
    """benchmarks/convpaths.py end to end on tiny shapes: im2col equals F.unfold and the stem's features
    equal those by batch-as-groups (the script stops otherwise), and a row is saved per shape."""
    out = tmp_path / "convpaths.json"
    proc = run_script("convpaths.py", "--quick", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert len(report["unfold"]) == 2 and len(report["stem_features"]) == 1
    assert all(r["im2col_us"] > 0 and r["F.unfold_us"] > 0 for r in report["unfold"])
    assert "| stem input -> outputs |" in proc.stdout


def test_tf32_errors_are_float32_round_off_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "tf32.json"
    proc = run_script("tf32.py", "--quick", "--workloads", "cnn", "--steps", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["tf32"], row["step"]) for row in rows] == [(True, 0), (True, 1), (False, 0), (False, 1)]
    for row in rows:  # the CPU has no TF32: float32 round-off either way, for autograd and for every target
        assert set(row["features"]) == {"model", "0", "3", "7", "9"}
        assert row["plain_grad"] < 1e-5 and max(row["features"].values()) < 1e-5, row


def _load_lds() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("lds_benchmark", ROOT / "benchmarks" / "lds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lds_benchmark"] = module
    spec.loader.exec_module(module)
    return module


def test_the_lds_benchmarks_exact_influence_is_the_parameter_space_formula() -> None:
    """``kernel_influence`` (the kernel form) equals ``g_z^T (G^T G + lambda I)^{-1} g_i`` in parameter space."""
    lds_benchmark: Any = _load_lds()
    gen = torch.Generator().manual_seed(0)
    train = [
        torch.randn(9, 6, generator=gen, dtype=torch.float64),
        torch.randn(9, 14, generator=gen, dtype=torch.float64),
    ]
    test = [
        torch.randn(4, 6, generator=gen, dtype=torch.float64),
        torch.randn(4, 14, generator=gen, dtype=torch.float64),
    ]
    q = torch.rand(9, generator=gen, dtype=torch.float64)
    want = torch.zeros(4, 9, dtype=torch.float64)
    for g, gz in zip(train, test):
        lam = 0.01 * (g @ g.T).trace() / 9
        want += gz @ torch.linalg.inv(g.T @ g + lam * torch.eye(g.shape[1], dtype=torch.float64)) @ g.T
    torch.testing.assert_close(lds_benchmark.kernel_influence(train, test, 0.01), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lds_benchmark.kernel_influence(train, test, 0.01, q), want * q, rtol=1e-10, atol=1e-12)


def test_tiny_lds_benchmark_runs_every_route(tmp_path: Path) -> None:
    out = tmp_path / "lds.json"
    proc = run_script("lds.py", "--tiny", "--tasks", "digits", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["tasks"]["digits"]["results"]
    assert {
        "trak, kron, k=16",
        "gram (loss), kron, k=16",
        "tracin, kron, k=16",
        "exact influence (unprojected)",
    } <= set(results)
    assert any(label.startswith("ekfac (sampled Fisher)") for label in results)
    for label, row in results.items():
        assert "error" not in row, label
        assert -1 <= row["lds"] <= 1, label


def test_hostcost_saves_a_row_per_workload_and_method(tmp_path: Path) -> None:
    """benchmarks/hostcost.py end to end, one round: a row per workload and method run, plain's ratio 1, CPU
    and wall time (``--device``: on a GPU the wall time includes the kernels)."""
    out = tmp_path / "hostcost.json"
    proc = run_script(
        "hostcost.py", "--workloads", "mlp", "--rounds", "1", "--steps", "1", "--warmup", "1",
        "--methods", "pergrad_hooks", "pergrad_clip", "--device", "cpu", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [(r["workload"], r["method"]) for r in report["rows"]] == [
        ("mlp", "plain"), ("mlp", "hooks only"), ("mlp", "fused clip"),
    ]  # fmt: skip
    assert report["rows"][0]["ratio"] == report["rows"][0]["wall_ratio"] == 1.0
    assert report["device"] == "cpu" and all(r["median_wall_ms"] > 0 for r in report["rows"])
    assert "| mlp |" in proc.stdout


def test_hostcost_compiled_measures_plain_and_pergrad_alone(tmp_path: Path) -> None:
    """``hostcost.py --compile``: every model's forward compiled; the peers are skipped with a line saying why."""
    out = tmp_path / "hostcost.json"
    proc = run_script(
        "hostcost.py", "--compile", "--workloads", "mlp", "--rounds", "1", "--steps", "1", "--warmup", "2",
        "--methods", "pergrad_clip", "opacus_hooks", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["compiled"] is True
    assert [r["method"] for r in report["rows"]] == ["plain", "fused clip"]
    assert report["skipped"] == {"mlp": {"Opacus hooks": "not compiled here (--compile measures plain and pergrad)"}}
    assert "every model compiled" in proc.stdout


def test_hostfloor_checks_its_steps_and_saves_a_row_per_method(tmp_path: Path) -> None:
    """``benchmarks/hostfloor.py``: the floor's and the sink's clipped ``.grad`` (eager and compiled) agree with a
    one-sample loop before anything is timed (the script raises otherwise)."""
    out = tmp_path / "hostfloor.json"
    proc = run_script("hostfloor.py", "--rounds", "1", "--steps", "1", "--warmup", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == [
        "plain", "floor", "floor, arithmetic compiled", "sink", "sink, compiled", "plain compiled",
    ]  # fmt: skip
    assert rows[0]["ratio"] == 1.0 and rows[-1]["ratio_to_compiled"] == 1.0


def test_the_kron_ranks_benchmark_draws_version_3_and_version_2s_ranks() -> None:
    """``benchmarks/kron_ranks.py``'s "v3" blocks are pergrad's own; its "v2" blocks have version 2's ranks
    (the larger on the narrower side) and factors drawn as version 2 drew them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("kron_ranks_benchmark", ROOT / "benchmarks" / "kron_ranks.py")
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from pergrad.attribution.projectors import Projector, Spec

    for shape, v2 in (((256, 32), (8, 16)), ((32, 256), (16, 8)), ((12, 12), (8, 16)), ((10, 64), (16, 8))):
        assert module.version2_ranks(128, *shape) == v2
        own = Projector(Spec(128, "kron", 3), "w", shape).matrix()
        assert torch.equal(module.matrix("w", shape, 128, 3, "v3"), own)
        old = module.matrix("w", shape, 128, 3, "v2")
        assert old.shape == own.shape and (shape[0] == shape[1]) == torch.equal(old, own)
    bias = Projector(Spec(128, "kron", 3), "b", (32,)).matrix()  # a CountSketch under every rule
    assert torch.equal(module.matrix("b", (32,), 128, 3, "v2"), bias)

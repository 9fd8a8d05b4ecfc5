"""experiments/accelerator_check.py and fla_timings.py: a kernel family checked against its
float64 host reference, the timed operations (chunk timed, pallas's refusal recorded, a spent
budget), a training step's time, MFU and memory with the deviceless prediction, the parent's
record of a part that is skipped, crashes or overruns, bad arguments; the whole tiny preset
end to end (slow)."""

import json
import math
import statistics
import sys

import numpy as np
import pytest

from linear_attention.training.gpu_target import cuda_missing
from linear_attention.training.mesh import make_mesh
from linear_attention.training.sizing import trace_train_step
from linear_attention.training.target_base import memory_parts
from tests.scripts import load_module


@pytest.fixture(scope="module")
def ac():
    return load_module("experiments/accelerator_check.py", "accelerator_check")


@pytest.fixture(scope="module")
def fla():
    return load_module("experiments/fla_timings.py", "fla_timings")


def test_host_reference_is_float64_on_the_cpu(ac):
    """The reference runs in float64, also where the code casts to jnp.float32 (as the kernels
    do for states and sums): 1 + 1e-12 survives it (float32 would round it to 1)."""
    import jax.numpy as jnp

    got = ac.on_host_float64(lambda x: x.astype(jnp.float32) + 1e-12, np.ones(3, np.float32))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got - 1.0, 1e-12, rtol=1e-3)
    assert jnp.float32 is not jnp.float64 and jnp.ones(2).dtype == np.float32  # restored


def test_one_family_is_checked_against_its_host_reference(ac):
    """The sliding window against the quadratic form with its band mask (T 37, window 7)."""
    checks = ac.run_family_checks(37, families=("sliding_window",))
    assert [(c["check"], c["dtype"]) for c in checks] == [
        ("forward", "float32"),
        ("gradient", "float32"),
        ("forward", "bfloat16"),
    ]
    assert all(c["ok"] and c["reference"] == "quadratic (float64, host)" for c in checks)
    assert checks[0]["rel_err"] < 1e-5 and checks[1]["rel_err"] < 1e-5
    assert 1e-5 < checks[2]["rel_err"] < ac.TOLERANCE["bfloat16"]  # bfloat16 inputs do round


@pytest.mark.slow
def test_the_delta_rules_pallas_is_checked_where_it_runs(ac):
    """The delta rule's pallas method: unavailable on the CPU (no kernel, no failure); in the
    Mosaic GPU interpreter (as on a lent GPU), its bfloat16 forward and gradient pass against
    the float64 host reference (slow: the next test)."""
    checks = ac.run_family_checks(37, families=("delta_rule",))
    pallas = [c for c in checks if c["method"] == "pallas"]
    assert [(c["check"], c["dtype"]) for c in pallas] == [
        ("forward", "bfloat16"),
        ("gradient", "bfloat16"),
    ]
    assert all("pallas" in c["unavailable"] and "ok" not in c for c in pallas)
    assert all(c["ok"] for c in checks if c["method"] == "chunk")
    assert ac.checks_passed({"parts": {"checks": {"result": {"family_checks": checks}}}})


@pytest.mark.slow
def test_the_delta_rules_pallas_passes_in_the_gpu_interpreter(ac):
    from linear_attention import kernels as K

    with K.pallas_interpret("gpu"):  # the lent GPU's kernels, interpreted
        checks = ac.run_family_checks(37, families=("delta_rule",))
    pallas = [c for c in checks if c["method"] == "pallas"]
    assert len(pallas) == 2 and all(c["ok"] for c in pallas)
    assert all(1e-4 < c["rel_err"] < ac.TOLERANCE["bfloat16"] for c in pallas)


def test_a_spent_budget_skips_the_checks(ac):
    checks = ac.run_family_checks(37, families=("softmax", "path"), deadline=0.0)
    assert [c["family"] for c in checks] == ["softmax", "path"]
    assert all(c["skipped"] == ac.SPENT and "ok" not in c for c in checks)


def test_op_timings_time_chunk_and_record_what_pallas_lacks(ac):
    """Gated DeltaNet's forward + backward at T 64: chunk timed; pallas, without a kernel on the
    CPU, recorded with the library's error. A spent deadline skips every point."""
    shape = dict(B=1, H=2, K=16, V=16)
    recs = ac.run_op_timings((64,), shape, 2, float("inf"), ops=("gated_delta_rule",), log=print)
    chunk, pallas = recs
    assert (chunk["method"], pallas["method"]) == ("chunk", "pallas")
    assert chunk["median_s"] == statistics.median(chunk["times_s"][1:]) > 0
    assert len(chunk["times_s"]) == 3 and chunk["T"] == 64 and chunk["K"] == 16
    assert "pallas" in pallas["error"] and "median_s" not in pallas
    spent = ac.run_op_timings((64, 128), shape, 1, 0.0, ops=("gla",), log=print)
    assert [(r["T"], r["method"]) for r in spent] == [
        (T, m) for T in (64, 128) for m in ("chunk", "chunk_parallel", "pallas")
    ]  # GLA has the chunk_parallel form too
    assert all(r["skipped"] == ac.SPENT for r in spent)


def test_op_inputs_match_fla_timings_order(ac, fla):
    """The JAX inputs of each operation are FLA's (fla_timings.OPS), in the library's order
    (beta before the decay), with q and k L2-normalised for the delta rules."""
    assert ac.OPS == tuple(fla.OPS)
    for op, (_, names) in fla.OPS.items():
        args, do = ac.op_inputs(op, 8, B=1, H=2, K=4, V=3)
        assert len(args) == len(names) and do.shape == (1, 8, 2, 3)
        if op in fla.NORMALISED:
            np.testing.assert_allclose(np.linalg.norm(np.float32(args[1]), axis=-1), 1, atol=1e-2)


def test_a_training_step_reports_tokens_mfu_and_memory(ac):
    """gla_340m at one narrow layer, 2 rows of 16: the first loss is a fresh model's (near
    ln 32000), MFU = flops · tokens/s / peak, and this compile's bytes hold at least the
    float32 parameters and AdamW's two moments."""
    cfg = ac.step_config("gla_340m", depth=1, narrow=True, seq_len=16, batch=2)
    assert (cfg.model.num_layers, cfg.model.d_model, cfg.model.vocab_size) == (1, 64, 32_000)
    rec = ac.run_train_step(cfg, repeats=2, peak_flops=1e12)
    assert abs(rec["first_loss"] - math.log(32_000)) < 0.5
    assert rec["step_s"] == statistics.median(rec["times_s"]) and len(rec["times_s"]) == 2
    assert rec["tokens_per_sec"] == pytest.approx(32 / rec["step_s"])
    assert rec["mfu"] == pytest.approx(rec["flops_per_token"] * rec["tokens_per_sec"] / 1e12)
    assert rec["compiled_bytes"] >= 3 * 4 * rec["parameters"]
    assert rec["measured_peak_bytes"] is None  # the CPU keeps no memory statistics


@pytest.mark.slow  # (a compile for an H100: ~20 s)
def test_the_prediction_is_the_deviceless_compile_for_the_chip(ac):
    """Off a GPU the prediction is an H100's (`gpu:h100:1`): it fits, its bytes are its parts'
    peak, and its arguments (the state and the batch: shapes, not the compiler's choice) are
    the bytes the CPU's compile of the same step takes."""
    missing = cuda_missing()
    if missing:
        pytest.skip(f"the deviceless GPU compile needs the gpu-compile extra: {missing}")
    cfg = ac.step_config("gla_340m", depth=1, narrow=True, seq_len=16, batch=2)
    predicted = ac.predict_memory(cfg)
    assert predicted["target"] == "gpu:h100:1" and predicted["fits"]
    m = predicted["memory"]
    assert predicted["bytes"] == m["arguments"] + m["outputs"] - m["aliases"] + m["temporaries"]
    cpu = memory_parts(trace_train_step(cfg, make_mesh(1, 1)).lower().compile())
    assert m["arguments"] == cpu["arguments"] > 0


def test_gpu_target_names_the_chip(ac):
    assert ac.gpu_target_name("NVIDIA H100 80GB HBM3") == "gpu:h100:1"
    assert ac.gpu_target_name("NVIDIA H200") == "gpu:h200:1"
    assert ac.gpu_target_name("cpu") == "gpu:h100:1"
    assert ac.peak_flops_of("NVIDIA H100 80GB HBM3") == 989.4e12 and ac.peak_flops_of("cpu") is None


def test_the_parent_records_a_part_skipped_crashed_or_killed(ac, monkeypatch, tmp_path):
    """FLA absent (or no CUDA device): skipped with the reason. A part that exits 3, and one
    that outlives its deadline plus the grace (keeping what it saved), are recorded; the run
    still writes its files."""
    res = ac.run(tmp_path / "a", "tiny", ("fla",), log=print)
    fla = res["parts"]["fla"]
    assert fla["returncode"] == 0 and "skipped" in fla["result"]
    assert (tmp_path / "a" / "summary.md").read_text().count("FLA: skipped") == 1
    assert json.loads((tmp_path / "a" / "results.json").read_text())["checks_passed"] is None

    crash = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    monkeypatch.setattr(ac, "part_command", lambda *a, **k: crash)
    res = ac.run(tmp_path / "b", "tiny", ("timings",), log=print)
    assert res["parts"]["timings"]["error"] == "exit 3: boom"
    monkeypatch.setattr(ac, "GRACE_S", 0.5)

    saved = {"records": [{"op": "gla", "method": "chunk", "T": 64, "median_s": 0.0125}]}

    def saves_then_hangs(name, preset, out, *args):
        code = f"open({str(out)!r}, 'w').write({json.dumps(saved)!r})\nwhile 1: 0"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(ac, "part_command", saves_then_hangs)
    res = ac.run(tmp_path / "c", "tiny", ("timings",), budget_s=0.5, log=print)
    timings = res["parts"]["timings"]
    assert timings["error"].startswith("killed") and timings["seconds"] < 10
    assert timings["result"] == saved  # what it saved before it was killed
    assert "| gla | 64 | 12.5 |" in (tmp_path / "c" / "summary.md").read_text()
    res = ac.run(tmp_path / "d", "tiny", ("timings", "fla"), budget_s=0.5, log=print)
    assert res["parts"]["fla"] == {"seconds": 0.0, "error": f"not started: {ac.SPENT}"}


def test_fla_timings_without_fla_or_a_gpu_says_why(fla, tmp_path):
    out = tmp_path / "fla.json"
    assert (
        fla.main(["--out", str(out), "--T", "64", *"--B 1 --H 2 --K 8 --V 8 --repeats 1".split()])
        == 0
    )
    got = json.loads(out.read_text())
    assert got["skipped"] == fla.why_not() and got["shape"]["H"] == 2
    with pytest.raises(SystemExit) as e:
        fla.main(["--out", str(out), "--T", "0", *"--B 1 --H 2 --K 8 --V 8 --repeats 1".split()])
    assert e.value.code == 2


def test_bad_arguments_raise(ac, tmp_path):
    with pytest.raises(ValueError, match="preset"):
        ac.run(tmp_path, "huge")
    with pytest.raises(ValueError, match="parts"):
        ac.run(tmp_path, "tiny", ("everything",))
    with pytest.raises(ValueError, match="peak_flops"):
        ac.run(tmp_path, "tiny", peak_flops=0.0)
    with pytest.raises(ValueError, match="budget_s"):
        ac.run(tmp_path, "tiny", budget_s=-1.0)


@pytest.mark.slow  # (every part of the tiny preset: minutes on 2 cores)
def test_tiny_preset_runs_every_part(ac, tmp_path):
    res = ac.run(tmp_path, "tiny", log=print)
    parts = res["parts"]
    assert set(parts) == {"checks", "timings", "fla", "train_gated_deltanet_400m",
                          "train_transformer_340m"}  # fmt: skip
    assert all("error" not in p and p["returncode"] == 0 for p in parts.values())
    assert res["checks_passed"]
    checks = parts["checks"]["result"]
    assert {c["family"] for c in checks["family_checks"]} == set(ac.FAMILIES)
    for c in checks["checks"] + checks["family_checks"]:
        assert c.get("ok") is True or "unavailable" in c
    timed = parts["timings"]["result"]["records"]
    assert {r["op"] for r in timed if "median_s" in r} == set(ac.OPS)
    for key in ("train_gated_deltanet_400m", "train_transformer_340m"):
        r = parts[key]["result"]
        assert r["tokens_per_sec"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])
        assert abs(r["first_loss"] - math.log(32_000)) < 0.5
        if not cuda_missing():
            assert r["predicted"]["fits"] and r["predicted"]["bytes"] > 3 * 4 * r["parameters"]

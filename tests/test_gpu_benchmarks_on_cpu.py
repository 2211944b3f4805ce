"""The GPU benchmarks run on the CPU at a tiny size (the paged kernel under Triton's interpreter): a check that the
scripts still run and still measure what they say, so that a GPU session's few minutes of device time are not lost
to a script that broke since (benchmarks/gpu_check.sh runs them on the GPU; ``gpu_train.py`` needs CUDA itself)."""

import json

from tests.helpers import run


def test_gpu_paged_runs_on_the_cpu_and_agrees_with_sdpa(tmp_path):
    proc = run(["benchmarks/gpu_paged.py", "--device", "cpu", "--out", str(tmp_path)])
    with open(tmp_path / "gpu_paged.json") as f:
        result = json.load(f)
    assert [(c["G"], c["d"]) for c in result["cases"]] == [(1, 64), (4, 64), (8, 64), (1, 128), (4, 128), (8, 128)]
    assert all(c["max_error_vs_sdpa"] < 1e-5 for c in result["cases"])  # fp32 under the interpreter
    assert (tmp_path / "gpu_paged.png").exists() and "goals (CPU (Triton interpreter)):" in proc.stdout


def test_gpu_decode_runs_on_the_cpu_and_fits_more_compressed_sequences(tmp_path):
    caches = ["full", "pool2", "gqa2", "h2o_1of4"]
    proc = run(["benchmarks/gpu_decode.py", "--device", "cpu", "--shape", "tiny", "--prompt", "32", "--new", "8",
                "--kv-mib", "4", "--rounds", "1", "--caches", *caches, "--out", str(tmp_path)])
    with open(tmp_path / "gpu_decode.json") as f:
        results = {r["name"]: r for r in json.load(f)["results"]}
    assert list(results) == caches and all(r["decode_tps"] > 0 for r in results.values())
    full = results["full"]["batch"]
    # one KV budget: a cache that keeps half or a quarter of the entries fits more sequences in it
    assert 2 * full <= results["gqa2"]["batch"] <= 2 * full + 1  # half the bytes a sequence (batches are whole)
    assert results["pool2"]["batch"] > full and results["h2o_1of4"]["batch"] > full
    assert results["full"]["hf_tps"] > 0 and "engine vs transformers generate" in proc.stdout

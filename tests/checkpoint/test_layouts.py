"""A converted checkpoint loads under TP2+SP, EP2, PP2 and CP2 (2 processes over gloo) and comes back bitwise: through
the online export (per rank and in buckets for weight sync) and through a save under that layout converted back
to HF. Logits match HF transformers to 1e-4 (fp32) at TP1 and under parallel layouts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sapo_megatron.checkpoint.mapping import RULES
from sapo_megatron.conversion.to_hf import megatron_to_hf
from tests.checkpoint.conftest import assert_bitwise_equal, read_hf_tensors
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]
PARITY_TOL = 1e-4
BUCKET_BYTES = 6000  # small: many buckets, some holding one oversized parameter
LAYOUTS = {
    "moe": [
        ("tp2-sp", {"tp": 2, "sequence_parallel": True}),
        ("ep2", {"ep": 2}),
        ("pp2", {"pp": 2}),
        ("cp2", {"cp": 2}),  # both ranks hold every weight: one exports, a save at cp 2 loads at cp 1
    ],
    "dense": [("tp2", {"tp": 2}), ("pp2", {"pp": 2})],
}
PARITY_LAYOUTS = {
    "moe-fp32 tp2-sp": ("moe-fp32", {"tp": 2, "sequence_parallel": True}),
    "moe-fp32 ep2": ("moe-fp32", {"ep": 2}),
    "dense-fp32 pp2": ("dense-fp32", {"pp": 2}),
    "moe-fp32 cp2": ("moe-fp32", {"cp": 2}),
}


def _cases(hf_checkpoints, converted, tmp_path):
    cases = []
    for key in hf_checkpoints:
        kind, dtype = key.split("-")
        for name, parallel in LAYOUTS[kind]:
            cases.append(
                {
                    "label": f"{key} {name}",
                    "hf_dir": str(hf_checkpoints[key]),
                    "mc_dir": str(converted[key]),
                    "parallel": parallel,
                    "dtype": dtype,
                    "bucket_bytes": BUCKET_BYTES,
                    "dst": len(cases) % 2,
                    "all_ranks": len(cases) % 3 == 2,
                    "save_dir": str(tmp_path / "resaved" / f"{key}-{name}"),
                }
            )
    return cases


@pytest.fixture(scope="module")
def layout_results(hf_checkpoints, converted, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("layouts")
    cases = _cases(hf_checkpoints, converted, tmp_path)
    parity = {
        label: {
            "hf_dir": str(hf_checkpoints[key]),
            "mc_dir": str(converted[key]),
            "parallel": parallel,
            "tolerance": PARITY_TOL,
        }
        for label, (key, parallel) in PARITY_LAYOUTS.items()
    }
    results = run_distributed("tests.checkpoint.scenarios:layouts", 2, {"cases": cases, "parity": parity})
    return cases, results


def _unit(hf_name: str) -> tuple:
    """The Megatron parameter an HF tensor belongs to (q/k/v and gate/up share one)."""
    for rule in RULES:
        for pattern in rule.hf:
            regex = re.escape(pattern).replace(r"\{L\}", r"(\d+)").replace(r"\{E\}", r"(\d+)")
            match = re.fullmatch(regex, hf_name)
            if match:
                return (rule.megatron, *match.groups())
    raise AssertionError(f"{hf_name} matches no rule")


def _as_hf_dtype(exported: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    """The local spec keeps RMSNorm weights in fp32 inside a bf16 model: compare in the HF dtype, after
    checking that the upcast lost nothing."""
    out = {}
    for name, tensor in exported.items():
        want = reference[name]
        assert torch.equal(tensor, want.to(tensor.dtype)), name
        out[name] = tensor.to(want.dtype)
    return out


def test_online_export_is_bitwise_under_every_layout(hf_checkpoints, layout_results):
    cases, results = layout_results
    for case in cases:
        reference = read_hf_tensors(Path(case["hf_dir"]))
        merged: dict[str, torch.Tensor] = {}
        for rank in results:
            owned = rank["cases"][case["label"]]["owned"]
            assert not set(owned) & set(merged), f"{case['label']}: a tensor is exported by two ranks"
            merged.update(owned)
        assert_bitwise_equal(_as_hf_dtype(merged, reference), reference)


def test_weight_sync_buckets_equal_offline_conversion(layout_results):
    cases, results = layout_results
    for case in cases:
        reference = read_hf_tensors(Path(case["hf_dir"]))
        per_rank = [r["cases"][case["label"]]["buckets"] for r in results]
        assert len({len(b) for b in per_rank}) == 1, "ranks disagree on the number of buckets"
        received = per_rank[case["dst"]]
        for rank, buckets in enumerate(per_rank):
            if rank != case["dst"] and not case["all_ranks"]:
                assert all(b == [] for b in buckets), "a non-destination rank received tensors"
            elif rank != case["dst"]:
                assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in received]
        names = [n for bucket in received for n, _ in bucket]
        assert len(names) == len(set(names)), f"{case['label']}: a tensor was delivered twice"
        flat = dict(item for bucket in received for item in bucket)
        assert_bitwise_equal(_as_hf_dtype(flat, reference), reference)
        for bucket in received:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= BUCKET_BYTES or len({_unit(n) for n, _ in bucket}) == 1, (
                f"{case['label']}: bucket of {size} bytes exceeds {BUCKET_BYTES}"
            )


def test_checkpoint_saved_under_each_layout_converts_back_bitwise(layout_results, tmp_path):
    cases, _ = layout_results
    for case in cases:
        out = megatron_to_hf(case["save_dir"], tmp_path / case["label"].replace(" ", "_"), progress=False)
        assert_bitwise_equal(read_hf_tensors(out), read_hf_tensors(Path(case["hf_dir"])))


def test_logit_parity_under_parallel_layouts(layout_results):
    _, results = layout_results
    for label in PARITY_LAYOUTS:
        reports = [r["parity"][label] for r in results]
        assert reports[0] == reports[1], "ranks report different figures"
        report = reports[0]
        print(f"{label}: max |Δlogit| = {report['max_abs']:.3e}, cosine = {report['cosine']:.8f}")
        assert report["max_abs"] <= PARITY_TOL, report
        assert report["cosine"] > 1 - 1e-6


def test_logit_parity_single_process(hf_checkpoints, converted):
    payload = {
        key: {"hf_dir": str(hf_checkpoints[key]), "mc_dir": str(converted[key]), "tolerance": PARITY_TOL}
        for key in hf_checkpoints
    }
    (reports,) = run_distributed("tests.checkpoint.scenarios:parity_single", 1, payload)
    for key, report in reports.items():
        print(f"{key} tp1: max |Δlogit| = {report['max_abs']:.3e}, mean = {report['mean_abs']:.3e}")
        assert report["max_abs"] <= PARITY_TOL, (key, report)


def test_cli_verify_single_process(hf_checkpoints, converted):
    """The command users run; it prints the figures and the tolerance, and exits 0 within it."""
    cmd = [
        sys.executable,
        "-m",
        "sapo_megatron.conversion.cli",
        "convert",
        "verify",
        "--hf",
        str(hf_checkpoints["moe-fp32"]),
        "--megatron",
        str(converted["moe-fp32"]),
        "--tolerance",
        str(PARITY_TOL),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("logit parity"))
    print(line)
    assert "tolerance max |Δlogit| <= 1.0e-04; every weight equals the HF checkpoint's: OK" in line
    assert float(re.search(r"max \|Δlogit\| = (\S+),", line).group(1)) <= PARITY_TOL

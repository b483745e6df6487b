"""The conversion tools live in one module each; the names of the old ``conversion.convert`` still import."""

from __future__ import annotations

from sapo_megatron.conversion import convert, params, to_hf, to_megatron, verify


def test_the_old_module_names_are_the_split_modules_objects():
    assert convert.hf_to_megatron is to_megatron.hf_to_megatron
    assert convert.row_runs is to_megatron.row_runs
    assert convert.megatron_to_hf is to_hf.megatron_to_hf
    assert convert.DEFAULT_MAX_SHARD_BYTES == to_hf.DEFAULT_MAX_SHARD_BYTES == 5 * 1024**3
    assert convert.verify is verify.verify and convert.ParityReport is verify.ParityReport
    assert convert.DEFAULT_TOLERANCE == {"fp32": 1e-3, "bf16": 0.25}
    assert convert.ConversionError is params.ConversionError
    assert convert.plan_params is params.plan_params
    assert "config.json" not in convert.TOKENIZER_FILES and "tokenizer.json" in convert.TOKENIZER_FILES
    assert set(convert.__all__) <= set(dir(convert))


def test_the_megatron_side_helpers_left_dist_ckpt():
    from sapo_megatron.megatron import dist_ckpt, forward, parallel

    for name in ("parallel_context", "is_reporting_rank", "forward_logits"):
        assert not hasattr(dist_ckpt, name)
    assert callable(parallel.parallel_context) and callable(parallel.is_reporting_rank)
    assert callable(forward.forward_logits)

"""The rollout section: topology keys, weight-sync modes and their defaults, refusals that name the fix."""

from __future__ import annotations

import pytest

from sapo_megatron.config import ConfigError, apply_overrides, config_from_dict
from sapo_megatron.config.deprecated import DeprecatedConfigKey
from sapo_megatron.model.tiny import tiny_hf_config


def cfg(**rollout):
    return config_from_dict({"model": {"hf_config": tiny_hf_config("moe")}, "rollout": rollout})


def error_of(**rollout) -> str:
    with pytest.raises(ConfigError) as info:
        cfg(**rollout)
    return str(info.value)


def test_weight_sync_defaults_follow_the_engine():
    assert cfg().rollout.weight_sync == "tensor"  # the in-process CPU engine shares the trainer's memory
    assert cfg(engine="sglang", router_url="http://r:31000").rollout.weight_sync == "distributed"
    assert cfg(engine="cpu_http").rollout.weight_sync == "tensor"  # the server runs in-process


def test_the_engine_is_one_choice_of_three():
    assert [cfg(engine=kind).rollout.engine for kind in ("cpu", "cpu_http")] == ["cpu", "cpu_http"]
    message = error_of(engine="vllm")
    assert "rollout.engine" in message and "'cpu', 'cpu_http' or 'sglang'" in message and "'vllm'" in message
    assert "only used with rollout.engine=sglang" in error_of(engine="cpu_http", urls=["http://w:30000"])


def test_tensor_sync_to_remote_sglang_is_refused_with_the_reason():
    message = error_of(engine="sglang", urls=["http://w:30000"], weight_sync="tensor")
    assert (
        "CUDA IPC" in message
        and "weight_sync: distributed" in message
        and "rollout.colocation: split" in message
    )
    split = cfg(engine="sglang", urls=["http://w:30000"], weight_sync="tensor", colocation="split").rollout
    assert split.colocation.name == "split" and split.shares_devices and split.time_shared is None


def test_distributed_sync_needs_servers_in_other_processes():
    for engine in ("cpu", "cpu_http"):
        assert "servers in other processes" in error_of(engine=engine, weight_sync="distributed")


def test_sglang_needs_somewhere_to_find_its_servers():
    message = error_of(engine="sglang")
    assert (
        "rollout.urls" in message and "rollout.router_url" in message and "rollout.endpoints_file" in message
    )
    assert "only used with rollout.engine=sglang" in error_of(router_url="http://r:31000")


def test_endpoints_file_excludes_explicit_urls():
    message = error_of(engine="sglang", endpoints_file="/shared/rollout.json", urls=["http://w:30000"])
    assert "already names the router and the workers" in message


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_rollouts_need_servers_on_their_own_gpus(mode):
    sglang = {"engine": "sglang", "urls": ["http://w:30000"], "weight_sync": "tensor", "colocation": "split"}
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "model": {"hf_config": tiny_hf_config("moe")},
                "rollout": sglang,
                "trainer": {"rollout_mode": mode},
            }
        )
    message = str(info.value)
    assert f"trainer.rollout_mode: {mode}" in message and "rollout.colocation: none" in message
    assert message.count("\n") == 1  # one line under the header
    assert cfg(**sglang).trainer.rollout_mode == "sync"  # off by default
    remote = {**sglang, "colocation": "none", "weight_sync": "distributed"}
    tiny = {"hf_config": tiny_hf_config("moe")}
    assert (
        config_from_dict(
            {"model": tiny, "rollout": remote, "trainer": {"rollout_mode": mode}}
        ).trainer.rollout_mode
        == mode
    )


def test_async_rollout_is_read_as_rollout_mode_with_one_warning():
    tiny = {"hf_config": tiny_hf_config("moe")}
    remote = {"engine": "sglang", "urls": ["http://w:30000"], "weight_sync": "distributed"}
    with pytest.warns(DeprecatedConfigKey, match="use trainer.rollout_mode: one_step_off") as caught:
        old = config_from_dict({"model": tiny, "rollout": remote, "trainer": {"async_rollout": True}})
    assert len(caught) == 1
    assert old.trainer.rollout_mode == "one_step_off" and old.trainer.async_rollout
    with pytest.raises(ConfigError, match=r"keep trainer\.rollout_mode only"):
        config_from_dict(
            {"model": tiny, "rollout": remote, "trainer": {"async_rollout": True, "rollout_mode": "sync"}}
        )


def test_fully_async_settings_are_checked_with_their_fix():
    tiny = {"hf_config": tiny_hf_config("moe")}
    remote = {"engine": "sglang", "urls": ["http://w:30000"], "weight_sync": "distributed"}
    base = {"rollout_mode": "fully_async", "prompts_per_step": 8}
    with pytest.raises(ConfigError, match=r"set algorithm.correction \(tis or icepop\)"):
        config_from_dict({"model": tiny, "rollout": remote, "trainer": {**base, "stale_groups": "correct"}})
    with pytest.raises(ConfigError, match="raise it to at least 8"):
        config_from_dict({"model": tiny, "rollout": remote, "trainer": {**base, "async_buffer_groups": 4}})
    deterministic = {**base, "fully_async_deterministic": True}
    with pytest.raises(
        ConfigError, match=r"set trainer.async_inflight_chunks: 1 or trainer.fully_async_determ"
    ):
        config_from_dict(
            {"model": tiny, "rollout": remote, "trainer": {**deterministic, "async_inflight_chunks": 2}}
        )
    with pytest.raises(
        ConfigError, match=r"trainer.async_inflight_chunks: Input should be greater than or equal"
    ):
        config_from_dict({"model": tiny, "rollout": remote, "trainer": {**base, "async_inflight_chunks": 0}})
    assert (
        config_from_dict(
            {"model": tiny, "rollout": remote, "trainer": deterministic}
        ).trainer.async_inflight_chunks
        == 1
    )
    with pytest.raises(ConfigError, match="R2 needs"):
        config_from_dict(
            {
                "model": tiny,
                "rollout": remote,
                "trainer": base,
                "algorithm": {"proximal_logp": "loglinear", "routing_replay": "r2"},
            }
        )
    with pytest.raises(ConfigError, match="set is_batch_normalize: false"):
        config_from_dict(
            {
                "model": tiny,
                "rollout": remote,
                "trainer": base,
                "algorithm": {
                    "proximal_logp": "loglinear",
                    "correction": {"name": "rollout_corr", "is_level": "token", "is_batch_normalize": True},
                },
            }
        )


def test_retract_with_r3_is_refused_on_sglang_servers_and_allowed_in_process():
    """miles #3277 on SGLang 0.5.23 (measured in tests/sglang_real/test_pause.py): a retract pause returns the
    re-prefill's routes for the prefix, whose log-probs are the old version's; the client cannot tell a CPU server
    from SGLang, so both server engines are refused; the in-process engine keeps routes per forward."""
    tiny = {"hf_config": tiny_hf_config("moe")}
    trainer = {"rollout_mode": "fully_async", "prompts_per_step": 8, "pause_mode": "retract"}
    r3 = {"routing_replay": "r3"}
    servers = {
        "sglang": {"engine": "sglang", "urls": ["http://w:30000"], "routed_experts": True},
        "cpu_http": {"engine": "cpu_http", "routed_experts": True},
    }
    for engine, rollout in servers.items():
        with pytest.raises(ConfigError) as info:
            config_from_dict({"model": tiny, "rollout": rollout, "trainer": trainer, "algorithm": r3})
        message = str(info.value)
        assert (
            f"trainer.pause_mode: retract with algorithm.routing_replay: r3 on rollout.engine: {engine}"
            in message
        )
        assert "set trainer.pause_mode: in_place or abort" in message
        for mode in ("in_place", "abort"):  # the fix named is accepted
            fixed = {**trainer, "pause_mode": mode}
            config_from_dict({"model": tiny, "rollout": rollout, "trainer": fixed, "algorithm": r3})
        config_from_dict({"model": tiny, "rollout": rollout, "trainer": trainer})  # retract without R3
    in_process = {"engine": "cpu", "routed_experts": True}
    run = config_from_dict({"model": tiny, "rollout": in_process, "trainer": trainer, "algorithm": r3})
    assert run.trainer.pause_mode == "retract"


def test_time_sharing_needs_an_engine_it_can_release_and_names_the_fix():
    assert "set rollout.engine: cpu_http" in error_of(colocation="time_shared")
    shared = {"engine": "sglang", "urls": ["http://w:30000"], "weight_sync": "tensor"}
    section = cfg(**shared, colocation={"name": "time_shared"}).rollout.time_shared
    assert (section.offload_trainer, section.bucket_mb, section.check_weights) == (True, 512, False)
    assert "needs weight_sync: tensor" in error_of(
        engine="cpu_http", weight_sync="disk", colocation={"name": "time_shared", "check_weights": True}
    )
    assert "fp8" in error_of(
        engine="cpu_http", precision="fp8", colocation={"name": "time_shared", "check_weights": True}
    )
    assert "bucket_mb" in error_of(engine="cpu_http", colocation={"name": "time_shared", "bucket_mb": 0})


def test_colocation_is_one_choice_that_names_its_variants():
    message = error_of(colocation="shared")
    assert "rollout.colocation: unknown name 'shared'" in message
    assert (
        "none (no settings); split (no settings); time_shared (offload_trainer, bucket_mb, check_weights)"
        in message
    )
    message = error_of(engine="cpu_http", colocation={"name": "split", "bucket_mb": 1})
    assert (
        "rollout.colocation.split.bucket_mb: unknown key" in message
        and "--set rollout.colocation.name=time_shared" in message
    )


def test_time_sharing_refuses_async_rollout():
    with pytest.raises(ConfigError, match=r"trainer\.rollout_mode: one_step_off"):
        config_from_dict(
            {
                "model": {"hf_config": tiny_hf_config("moe")},
                "rollout": {"engine": "cpu_http", "colocation": "time_shared"},
                "trainer": {"rollout_mode": "one_step_off"},
            }
        )


def test_a_setting_overrides_a_colocation_given_by_its_name():
    raw = {
        "model": {"hf_config": tiny_hf_config("moe")},
        "rollout": {"engine": "cpu_http", "colocation": "time_shared"},
    }
    apply_overrides(raw, {"rollout.colocation.bucket_mb": 8})
    assert config_from_dict(raw).rollout.time_shared.bucket_mb == 8
    raw["rollout"]["colocation"] = "split"
    apply_overrides(
        raw, {"rollout.colocation.name": "time_shared", "rollout.colocation.offload_trainer": False}
    )
    assert config_from_dict(raw).rollout.time_shared.offload_trainer is False

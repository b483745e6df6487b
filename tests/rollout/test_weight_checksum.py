"""SGLang's served layout and checksum of a checkpoint, and the streaming form the colocated sync computes
(the layout itself is checked against real SGLang 0.5.23 in tests/sglang_real/test_memory.py)."""

from __future__ import annotations

import hashlib

import torch

from sapo_megatron.rollout.weight_checksum import (
    ChecksumStream,
    expected_checksums,
    served_layout,
    tensor_checksum,
)


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    named = [
        ("model.embed_tokens.weight", r(52, 8)),
        ("lm_head.weight", r(52, 8)),
        ("model.norm.weight", r(8)),
    ]
    for layer in range(2):
        p = f"model.layers.{layer}."
        named += [(p + f"self_attn.{x}_proj.weight", r(8 if x == "q" else 4, 8)) for x in "qkv"]
        named += [(p + "self_attn.o_proj.weight", r(8, 8)), (p + "mlp.gate.weight", r(3, 8))]
        for e in range(3):
            named += [
                (p + f"mlp.experts.{e}.{x}_proj.weight", r(6, 8) if x != "down" else r(8, 6))
                for x in ("gate", "up", "down")
            ]
    return named


def test_tensor_checksum_is_sglangs_sha256_prefix():
    t = torch.arange(4, dtype=torch.float32)
    assert tensor_checksum(t) == hashlib.sha256(t.numpy().tobytes()).digest()[:8].hex()
    assert tensor_checksum(t) != tensor_checksum(t.to(torch.bfloat16))


def test_served_layout_fuses_and_pads_like_sglang():
    named = dict(_checkpoint())
    served = served_layout(named)
    p = "model.layers.1."
    assert torch.equal(
        served[p + "self_attn.qkv_proj.weight"],
        torch.cat([named[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
    )
    w13 = served[p + "mlp.experts.w13_weight"]
    assert w13.shape == (3, 12, 8) and torch.equal(w13[2, 6:], named[p + "mlp.experts.2.up_proj.weight"])
    assert served[p + "mlp.experts.w2_weight"].shape == (3, 8, 6)
    embed = served["model.embed_tokens.weight"]
    assert (
        embed.shape == (64, 8)
        and torch.equal(embed[:52], named["model.embed_tokens.weight"])
        and not embed[52:].any()
    )
    assert not any(".experts.0." in n or "q_proj" in n for n in served)


def test_stream_over_buckets_equals_the_whole_checkpoint_in_the_served_dtype():
    named = _checkpoint()
    stream = ChecksumStream(torch.bfloat16)
    for start in range(0, len(named), 5):  # buckets cut across layers and fused groups
        stream.add(named[start : start + 5])
    assert stream.finish() == expected_checksums(named, torch.bfloat16)
    assert expected_checksums(named, torch.bfloat16) != expected_checksums(named)

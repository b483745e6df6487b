"""Qwen3-VL-MoE on Megatron-Core against transformers' ``Qwen3VLMoeForConditionalGeneration`` (single process,
fp32, CPU): logits on text + image rows, the interleaved MRoPE table and 3-D positions, DeepStack, gradients into
the vision tower, a frozen tower, packing with images, bad inputs."""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from sapo_megatron.checkpoint.fused_experts import unfuse
from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.megatron import cpu_compat
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
from sapo_megatron.megatron.packed_seq import block_causal_mask
from sapo_megatron.megatron.parallel import parallel_context
from sapo_megatron.megatron.vl_model import InterleavedMRoPE, VisionInputError, mrope_positions
from sapo_megatron.megatron.weights import iter_hf_weights, load_hf_weights
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.tiny import build_hf_model, tiny_vl_hf_config, vl_batch

LOGIT_ATOL = 1e-5
"""fp32 bound on max |Δlogit| against transformers (measured: 1.2e-7 on logits of magnitude ~0.5)."""

# three rows: two images of different sizes (6 and 1 merged tokens), one image (4 tokens), text only
ROWS = [[5, (32, 48), 7, (16, 16), 3], [4, (40, 24), 9], [12]]


@pytest.fixture(scope="module")
def hf_config():
    return tiny_vl_hf_config()


@pytest.fixture(scope="module")
def arch(hf_config):
    return QwenArch.from_hf_dict(hf_config)


@pytest.fixture(scope="module")
def hf_model(hf_config):
    return build_hf_model(hf_config, seed=1)


@pytest.fixture(scope="module")
def batch(arch):
    return vl_batch(arch, ROWS, seed=2)


@pytest.fixture(scope="module")
def megatron(hf_config):
    """Single-process Megatron state for the whole module, and a builder of models holding the HF weights."""
    cfg = config_from_dict({"model": {"hf_config": hf_config}, "launch": {"procs_per_node": 1}})
    with parallel_context(cfg):

        def build(hf, **model):
            run = cfg.model.model_copy(update=model)
            module = build_gpt_model(BuildOptions(run, cfg.parallel, cfg.precision))
            load_hf_weights(module, unfuse(hf.state_dict()).__getitem__, cfg.model.arch)
            return module.eval()

        yield build


def _megatron_logits(model, batch, **extra):
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    return model(batch["input_ids"], extra.pop("position_ids", None), None, **images, **extra)


def test_logits_match_transformers_on_images_of_several_sizes_and_text(hf_model, megatron, batch):
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2], [1, 4, 4]]
    with torch.no_grad():
        ref = hf_model(**batch).logits
        got = _megatron_logits(megatron(hf_model), batch)
    real = batch["attention_mask"].bool()
    assert got.shape == ref.shape
    assert (got - ref)[real].abs().max().item() <= LOGIT_ATOL


def test_text_only_batch_matches_transformers(hf_model, megatron, arch):
    batch = vl_batch(arch, [[20], [13]], seed=4)
    assert "pixel_values" not in batch
    with torch.no_grad():
        ref = hf_model(input_ids=batch["input_ids"]).logits
        got = _megatron_logits(megatron(hf_model), batch)
    assert (got - ref).abs().max().item() <= LOGIT_ATOL


def test_deepstack_features_reach_the_language_model(hf_config, megatron, batch):
    """A change to the last DeepStack merger moves the logits of both models alike, and only from the first
    image token on (DeepStack adds at image positions after LM layer 2)."""
    base, changed = build_hf_model(hf_config, seed=1), build_hf_model(hf_config, seed=1)
    with torch.no_grad():
        changed.model.visual.deepstack_merger_list[2].linear_fc2.bias.add_(0.5)
        moved = (changed(**batch).logits - base(**batch).logits).abs()
        got = _megatron_logits(megatron(changed), batch)
        ref = changed(**batch).logits
    first_image = int((batch["input_ids"][0] == hf_config["image_token_id"]).nonzero()[0])
    assert moved[0, :first_image].max().item() == 0.0
    assert moved[0, first_image:].max().item() > 1e-3
    assert moved[2].max().item() == 0.0  # the text-only row
    real = batch["attention_mask"].bool()
    assert (got - ref)[real].abs().max().item() <= LOGIT_ATOL


def test_interleaved_mrope_matches_transformers_and_megatron_chunked_one_does_not(hf_model, arch, batch):
    positions = hf_model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )[0]
    rotary = hf_model.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, d]
    table = InterleavedMRoPE(arch.head_dim, arch.rope_theta, arch.mrope_section)(positions)  # [s, b, 1, d]
    assert torch.equal(table[:, :, 0].cos().transpose(0, 1), cos)
    assert torch.equal(table[:, :, 0].sin().transpose(0, 1), sin)
    cpu_compat.apply()  # Megatron's rotary asks torch.cuda for its device (whatever test ran before this one)
    chunked = MultimodalRotaryEmbedding(arch.head_dim, 1.0, rotary_base=int(arch.rope_theta))
    wrong = chunked(positions, list(arch.mrope_section))  # the Qwen2-VL layout: angles off on image tokens
    text_only = batch["mm_token_type_ids"][2].bool().logical_not()
    assert torch.equal(wrong[:, 2][text_only], table[:, 2][text_only])
    assert (wrong - table).abs().max().item() > 0.3  # rad; positions here are < 20 (5.5 rad at real sizes)


def test_positions_follow_get_rope_index_and_restart_per_packed_segment(hf_model, arch, batch):
    real = batch["attention_mask"].bool()
    ref = hf_model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )[0]
    kwargs = {"image_token_id": arch.image_token_id, "spatial_merge_size": arch.vision.spatial_merge_size}
    got = mrope_positions(batch["input_ids"], None, batch["image_grid_thw"], **kwargs)
    assert torch.equal(got[:, real], ref[:, real])
    # rows 0 and 1 packed into one row: positions restart where position_ids do
    packed, position_ids, _ = _pack(batch, rows=[0, 1])
    got = mrope_positions(packed, position_ids, batch["image_grid_thw"][:3], **kwargs)  # rows 0, 1: 3 images
    n0, n1 = (int(n) for n in batch["attention_mask"][:2].sum(1))
    assert torch.equal(got[:, 0, :n0], ref[:, 0, :n0])
    assert torch.equal(got[:, 0, n0 : n0 + n1], ref[:, 1, :n1])


def _pack(batch, rows):
    """The real tokens of ``rows`` in one row, with 1-D positions restarting per sequence."""
    lengths = [int(batch["attention_mask"][r].sum()) for r in rows]
    ids = torch.cat([batch["input_ids"][r, :n] for r, n in zip(rows, lengths)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, position_ids, lengths


def test_packed_row_with_images_gives_the_padded_logits(hf_model, megatron, batch, arch):
    model = megatron(hf_model)
    ids, position_ids, lengths = _pack(batch, rows=[0, 1])
    patches = int(batch["image_grid_thw"][:3].prod(-1).sum())  # rows 0 and 1 hold the first three images
    with torch.no_grad():
        padded = _megatron_logits(model, batch)
        packed = model(
            ids,
            position_ids,
            block_causal_mask(position_ids),
            pixel_values=batch["pixel_values"][:patches],
            image_grid_thw=batch["image_grid_thw"][:3],
        )
    n0, n1 = lengths
    assert (packed[0, :n0] - padded[0, :n0]).abs().max().item() <= LOGIT_ATOL
    assert (packed[0, n0:] - padded[1, :n1]).abs().max().item() <= LOGIT_ATOL


def test_gradients_reach_the_vision_tower_like_transformers(hf_config, megatron, batch):
    hf = build_hf_model(hf_config, seed=1)
    model = megatron(hf)
    vocab = hf_config["text_config"]["vocab_size"]
    weights = torch.randn((*batch["input_ids"].shape, vocab), generator=torch.Generator().manual_seed(5))
    weights *= batch["attention_mask"][..., None]
    (hf(**batch).logits * weights).sum().backward()
    (_megatron_logits(model, batch) * weights).sum().backward()
    for name in (
        "patch_embed.proj.weight",
        "deepstack_merger_list.0.linear_fc1.weight",
        "merger.linear_fc2.bias",
    ):
        ref = hf.model.visual.get_parameter(name).grad
        got = model.visual.get_parameter(name).grad
        assert ref.abs().max() > 0
        assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), name


def test_frozen_vision_tower_gets_no_gradient(hf_model, megatron, batch):
    model = megatron(hf_model, freeze_vision=True).train()
    _megatron_logits(model, batch).sum().backward()
    assert all(not p.requires_grad and p.grad is None for p in model.visual.parameters())
    assert model.embedding.word_embeddings.weight.grad.abs().max() > 0
    # the tower's weights are still exported for conversion (weight sync leaves them out when frozen)
    names = {name for name, _ in iter_hf_weights(model, model.arch)}
    assert "model.visual.patch_embed.proj.weight" in names


def test_freeze_vision_on_a_text_model_is_refused():
    from sapo_megatron.model.tiny import tiny_hf_config

    cfg = config_from_dict({"model": {"hf_config": tiny_hf_config(), "freeze_vision": True}})
    with pytest.raises(ConfigError, match="has no vision tower"):
        build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))


def test_image_tokens_that_do_not_fit_the_grids_are_refused(hf_model, megatron, batch):
    model = megatron(hf_model)
    with pytest.raises(VisionInputError, match="needs 4"):
        model(
            batch["input_ids"],
            None,
            None,
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"][[0, 2, 1]],
        )
    with pytest.raises(VisionInputError, match="more images than image_grid_thw lists"):
        model(batch["input_ids"], None, None)
    with pytest.raises(VisionInputError, match="no pixel_values"):
        model(batch["input_ids"], None, None, image_grid_thw=batch["image_grid_thw"])


def test_deepstack_layers_beyond_the_first_pipeline_stage_are_refused(hf_config):
    from sapo_megatron.megatron.vl_model import check_vl_layout

    arch = QwenArch.from_hf_dict(hf_config)
    with pytest.raises(ConfigError, match="DeepStack levels must all sit there"):
        check_vl_layout(arch, pp=2, recompute="none")
    check_vl_layout(
        QwenArch.from_hf_dict(tiny_vl_hf_config(text={"num_hidden_layers": 6})), pp=2, recompute="none"
    )


def test_planner_counts_the_parameters_megatron_builds(hf_config, hf_model, megatron):
    from sapo_megatron.plan import stage_shards

    model = megatron(hf_model, freeze_vision=True)
    cfg = config_from_dict({"model": {"hf_config": hf_config, "freeze_vision": True}})
    (shard,) = stage_shards(cfg)
    assert (
        shard.params
        == sum(p.numel() for p in model.parameters())
        == sum(p.numel() for p in hf_model.parameters())
    )
    assert shard.frozen_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)


def test_weight_sync_leaves_a_frozen_vision_tower_out(hf_model, megatron):
    from sapo_megatron.megatron.weights import iter_hf_buckets

    def synced(model, **kwargs):
        return {
            name for bucket in iter_hf_buckets(model, model.arch, 1 << 20, **kwargs) for name, _ in bucket
        }

    trained, frozen = megatron(hf_model), megatron(hf_model, freeze_vision=True)
    everything = synced(trained)
    vision = {n for n in everything if n.startswith("model.visual.")}
    assert len(vision) == len(trained.arch.vision.tensor_shapes())
    assert synced(frozen) == everything - vision
    assert synced(frozen, include_frozen=True) == everything  # a whole checkpoint on disk keeps it


def test_routing_replay_covers_image_tokens(hf_config, hf_model, megatron, batch, tmp_path):
    """R3 on a VL model: recorded routes cover every LM token (image tokens included); replaying them gives the
    live logits bitwise, and other experts replayed at the image tokens only change the logits from there on."""
    from sapo_megatron.megatron.train_step import TrainEngine

    megatron(hf_model)  # the module's parallel state
    hf_model.save_pretrained(tmp_path / "hf")
    raw = {"model": {"hf_config": hf_config, "init": "hf", "init_path": str(tmp_path / "hf")}}
    engine = TrainEngine(config_from_dict(raw), routing_replay=True, total_steps=1)
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    micro = {"input_ids": batch["input_ids"], **images}

    def logits(logits_bsv, mb):
        return logits_bsv.float().clone()

    (live,) = engine.forward_only([micro], logits, record_routes=True)
    routes = micro.pop("recorded_routes")
    is_image = batch["input_ids"] == hf_config["image_token_id"]
    layers = hf_config["text_config"]["num_hidden_layers"]
    assert routes.shape == (*batch["input_ids"].shape, layers, 2)
    assert bool((routes[is_image] >= 0).all()) and bool((routes >= 0).all())
    (replayed,) = engine.forward_only(
        [{**micro, "engine_routes": routes}], logits, replay_key="engine_routes"
    )
    assert torch.equal(replayed, live)
    other = routes.clone()
    other[is_image] = (other[is_image] + 1) % hf_config["text_config"][
        "num_experts"
    ]  # still distinct experts
    (moved,) = engine.forward_only([{**micro, "engine_routes": other}], logits, replay_key="engine_routes")
    first = int(is_image[0].nonzero()[0])
    assert torch.equal(moved[0, :first], live[0, :first])
    assert (moved[0, first:] - live[0, first:]).abs().max() > 1e-4
    assert torch.equal(moved[2], live[2])  # the text-only row


def test_conversion_layout_of_the_tower_is_the_real_towers(arch, hf_model):
    from sapo_megatron.megatron.vl_model import vision_layout

    real = {n: tuple(p.shape) for n, p in hf_model.model.visual.named_parameters()}
    assert {n: tuple(p.shape) for n, p in vision_layout(arch.vision).named_parameters()} == real


def test_megatron_checkpoint_round_trip_keeps_the_tower(hf_config, hf_model, megatron, tmp_path):
    """save_model_weights → load_model_weights into a model of other weights: every tensor back, bitwise."""
    from sapo_megatron.megatron.dist_ckpt import load_model_weights, save_model_weights

    source = megatron(hf_model)
    save_model_weights(source, tmp_path / "ckpt", arch=source.arch)
    target = megatron(build_hf_model(hf_config, seed=9))
    assert not torch.equal(target.visual.pos_embed.weight, source.visual.pos_embed.weight)
    load_model_weights(target, tmp_path / "ckpt")
    want = dict(source.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in target.named_parameters())


@pytest.mark.usefixtures("megatron")  # the module's parallel state
def test_dense_qwen3_vl_matches_transformers(batch):
    """The dense Qwen3-VL (model_type qwen3_vl): the same tower, MRoPE and DeepStack over a dense LM."""
    hf_config = tiny_vl_hf_config(moe=False)
    hf = build_hf_model(hf_config, seed=4)
    cfg = config_from_dict({"model": {"hf_config": hf_config}})
    model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    load_hf_weights(model, hf.state_dict().__getitem__, cfg.model.arch)
    with torch.no_grad():
        ref = hf(**batch).logits
        got = _megatron_logits(model.eval(), batch)
    real = batch["attention_mask"].bool()
    assert (got - ref)[real].abs().max().item() <= LOGIT_ATOL

"""A Qwen3-VL-MoE whose expert sizes make the two fused-expert layouts the same shape loads to the model it was.

transformers 5 reads a hub-layout checkpoint (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, what every
export here writes) with ``Transpose(1, 2, check_dims=True)``: it transposes only when the shapes differ. With
``H = I`` (the CPU VL demo: hidden 64, experts 64) ``down_proj`` keeps the file's layout, with ``H = 2I``
``gate_up_proj`` does – silently wrong weights. That is why ``eval --model RUN`` on the VL demo's run did not
reproduce the run's own evaluation (issue 38: 1 of 192 responses identical): the run's engine got its weights
by tensor sync from Megatron, the evaluation loaded the export from disk. Both fail on 3855bb6 and before this
test (``_load_model`` returned what transformers loaded)."""

from __future__ import annotations

import pytest
import torch
import transformers

from sapo_megatron.rollout.cpu.engine import _load_model
from tests.vl_fixtures import make_vl_tokenizer, tiny_vl_config, to_hub_layout


@pytest.mark.parametrize(("hidden", "inter", "fixed"), [(32, 32, "down_proj"), (32, 16, "gate_up_proj")])
def test_a_hub_layout_export_with_square_experts_loads_as_saved(tmp_path, hidden, inter, fixed):
    directory = make_vl_tokenizer(tmp_path / "model")
    config = tiny_vl_config(directory)
    config["text_config"].update(hidden_size=hidden, moe_intermediate_size=inter)
    config["vision_config"]["out_hidden_size"] = hidden
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.AutoConfig.for_model(**config)
    ).eval()
    model.save_pretrained(str(directory))
    to_hub_layout(directory)  # the layout export_hf and megatron-to-hf write
    expected = model.state_dict()
    with_transformers = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        str(directory)
    ).state_dict()
    wrong = [n for n, t in expected.items() if not torch.equal(t, with_transformers[n])]
    assert wrong and all(
        n.endswith(fixed) for n in wrong
    )  # transformers' own load: the ambiguous tensor only
    loaded = _load_model(directory).state_dict()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)

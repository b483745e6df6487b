"""The policy loss hook on plain tensors (no process group): it equals the algo loss on naive log-probs, its
micro-batch contributions and (weighted_sum, weight) metrics add up to the full-batch values for every loss and
aggregation mode, and it names missing inputs."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import TIS, build_policy_loss
from sapo_megatron.megatron.loss_hook import (
    IS_WEIGHT_MEAN_KEY,
    LogprobOutput,
    PolicyLossHook,
    add_global_normalisers,
    global_is_weight_mean,
    global_normalisers,
)
from sapo_megatron.model.step_batch import MicroBatch

VOCAB = 50
LOSSES = {
    "sapo-seq-mean-token-mean": {"name": "sapo", "entropy_coef": 0.01, "kl_coef": 0.02},
    "sapo-token-mean": {"name": "sapo", "agg": "token-mean"},
    "sapo-seq-mean-token-sum-norm": {"name": "sapo", "agg": "seq-mean-token-sum-norm", "max_len": 12},
    "sapo-sequence-level": {"name": "sapo", "level": "sequence"},
    "grpo": {"name": "grpo", "dual_clip": 3.0},
    "gspo": {"name": "gspo", "eps_low": 0.05, "eps_high": 0.06},
}


def naive_logp(logits, labels, temperature=1.0):
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lsm.gather(-1, labels[..., None])[..., 0], -(lsm.exp() * lsm).sum(-1)


def make_batch(seed=0, batch=6, seq=12, spans=False):
    """A realistic batch: prompts masked, varied response lengths, padding holding NaN, advantages of both
    signs, old/rollout log-probs away from the current ones, one row without any response token. ``spans``:
    multi-turn episodes, whose responses have holes (tool observations: mask 0, rollout log-prob 0)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, VOCAB, generator=gen) * 2.0
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    positions = torch.arange(seq)
    prompt = torch.tensor([2, 3, 1, 4, 2, 12])[:batch, None]
    end = torch.tensor([12, 9, 7, 12, 5, 12])[:batch, None]
    mask = (positions >= prompt) & (positions < end)
    tool = mask & (positions % 5 == 4) if spans else torch.zeros_like(mask)  # 1–2 holes per row
    mask &= ~tool
    logp, _ = naive_logp(logits, labels)
    old = logp + 0.3 * torch.randn(batch, seq, generator=gen)
    rollout = old + 0.1 * torch.randn(batch, seq, generator=gen)
    ref = logp + 0.2 * torch.randn(batch, seq, generator=gen)
    for t in (old, rollout, ref):
        t[~mask] = float("nan")
        t[tool] = 0.0
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, 0.3])[:batch]
    data = {
        "labels": labels,
        "loss_mask": mask.long(),
        "old_logp": old,
        "rollout_logp": rollout,
        "ref_logp": ref,
        "advantages": adv,
    }
    return logits, data


def split(data, logits, sizes):
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        out.append((logits[rows], {k: v[rows] for k, v in data.items()}))
        start += size
    return out


def run_hook(hook, logits, data, sizes):
    """Sum of micro-batch contributions, the engine's metric reduction, and the logits gradient."""
    leaf = logits.clone().requires_grad_()
    pieces = split(data, leaf, sizes)
    batches = add_global_normalisers([b for _, b in pieces], dp_group=None)
    total, sums = 0.0, {}
    for (lg, _), batch in zip(pieces, batches):
        loss, metrics = hook(lg.contiguous() * 1.0, batch)
        loss.backward()
        total += float(loss.detach())
        for name, pair in metrics.items():
            sums[name] = sums.get(name, 0) + pair.double()
    reduced = {n: float(p[0] / p[1].clamp(min=1e-12)) for n, p in sums.items()}
    return total, reduced, leaf.grad


@pytest.mark.parametrize("spans", [False, True], ids=["one-span", "multi-span"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_hook_equals_algo_loss_and_is_split_invariant(name, spans):
    logits, data = make_batch(spans=spans)
    if spans:
        assert ((data["loss_mask"][:, 1:] - data["loss_mask"][:, :-1]) == 1).sum() > batch_rows_with_tokens(
            data
        )
    loss_cfg = build_policy_loss(LOSSES[name])
    hook = PolicyLossHook(loss_cfg, {"name": "tis", "cap": 2.0}, tp_group=None, chunk_tokens=7)

    leaf = logits.clone().requires_grad_()
    logp, entropy = naive_logp(leaf, data["labels"])
    ref_loss, ref_metrics = loss_cfg.compute(
        logp,
        data["old_logp"],
        data["advantages"],
        data["loss_mask"],
        rollout_logp_bt=data["rollout_logp"],
        ref_logp_bt=data["ref_logp"],
        entropy_bt=entropy if loss_cfg.entropy_coef > 0 else entropy.detach(),
        correction=TIS(cap=2.0),
    )
    ref_loss.backward()

    for sizes in ([6], [1, 2, 3], [2, 2, 2]):
        total, reduced, grad = run_hook(hook, logits, data, sizes)
        assert total == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad, leaf.grad, atol=1e-7, rtol=1e-5)
        assert reduced["loss/total"] == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
        for metric, value in ref_metrics.items():
            if metric.endswith(("min", "max")):
                assert metric not in reduced  # extrema cannot travel as (sum, weight)
            else:
                assert reduced[metric] == pytest.approx(float(value), rel=1e-5, abs=1e-6), metric


def test_hook_reads_temperature_and_computes_in_fp32_for_bf16_logits():
    logits, data = make_batch()
    batches = add_global_normalisers([data], dp_group=None)
    hot = PolicyLossHook({"name": "sapo"}, tp_group=None, temperature=0.7)
    cold = PolicyLossHook({"name": "sapo"}, tp_group=None)
    assert float(hot(logits.clone(), batches[0])[0]) != pytest.approx(
        float(cold(logits.clone(), batches[0])[0])
    )
    bf16_loss, _ = cold(logits.bfloat16(), batches[0])
    fp32_loss, _ = cold(logits.bfloat16().float(), batches[0])
    assert bf16_loss.dtype == torch.float32
    assert float(bf16_loss) == pytest.approx(float(fp32_loss), rel=1e-6)


def test_entropy_is_logged_without_a_gradient_path_unless_its_coefficient_is_set():
    logits, data = make_batch()
    batch = add_global_normalisers([data], dp_group=None)[0]
    _, metrics = PolicyLossHook({"name": "sapo"}, tp_group=None)(logits, batch)
    assert "entropy" in metrics
    _, metrics = PolicyLossHook({"name": "sapo"}, tp_group=None, log_entropy=False)(logits, batch)
    assert "entropy" not in metrics


def test_output_fn_gives_logp_and_entropy():
    logits, data = make_batch()
    logp, entropy = naive_logp(logits, data["labels"], temperature=0.8)
    out = LogprobOutput(tp_group=None, temperature=0.8)(logits, data)
    torch.testing.assert_close(out, logp, atol=2e-5, rtol=0)
    both = LogprobOutput(tp_group=None, temperature=0.8, with_entropy=True)(logits, data)
    assert both.shape == (2, *logp.shape)
    torch.testing.assert_close(both[1], entropy, atol=2e-5, rtol=0)


def test_global_normalisers_count_sequences_with_a_valid_token():
    _, data = make_batch()
    num_sequences, num_tokens = global_normalisers(
        [{"loss_mask": data["loss_mask"][:3]}, {"loss_mask": data["loss_mask"][3:]}], dp_group=None
    )
    assert float(num_sequences) == 5  # the last row is all prompt
    assert float(num_tokens) == float(data["loss_mask"].sum())


def test_missing_inputs_are_named():
    logits, data = make_batch()
    hook = PolicyLossHook({"name": "sapo"}, tp_group=None)
    with pytest.raises(KeyError, match="add_global_normalisers"):
        hook(logits, data)
    batch = add_global_normalisers([data], dp_group=None)[0]
    del batch["old_logp"]
    with pytest.raises(KeyError, match="old_logp"):
        hook(logits, batch)
    batch = add_global_normalisers([data], dp_group=None)[0]
    del batch["rollout_logp"]
    with pytest.raises(ValueError, match="rollout_logp"):
        PolicyLossHook({"name": "sapo"}, {"name": "icepop"}, tp_group=None)(logits, batch)


def pack_rows(logits, data, groups, tail=3):
    """Packed micro-batches ``[1, T]`` holding the rows of ``groups`` back to back (each row a slot, positions
    restarting), then ``tail`` tokens of padding (random logits, NaN inputs); an empty group is all tail."""
    seq = logits.shape[1]
    packed = []
    for group in groups:
        length = len(group) * seq + tail
        lg = torch.randn(1, length, logits.shape[-1], generator=torch.Generator().manual_seed(len(packed)))
        batch = {k: torch.full((1, length), float("nan")) for k in ("old_logp", "rollout_logp", "ref_logp")}
        batch["labels"] = torch.zeros(1, length, dtype=torch.long)
        batch["loss_mask"] = torch.zeros(1, length, dtype=torch.long)
        batch["segment_ids"] = torch.full((1, length), -1, dtype=torch.long)
        batch["position_ids"] = torch.arange(length).remainder(seq)[None]
        batch["position_ids"][0, len(group) * seq :] = torch.arange(tail)
        for slot, row in enumerate(group):
            cols = slice(slot * seq, (slot + 1) * seq)
            lg[0, cols] = logits[row]
            for key in ("old_logp", "rollout_logp", "ref_logp", "labels", "loss_mask"):
                batch[key][0, cols] = data[key][row]
            batch["segment_ids"][0, cols] = slot
        batch["advantages"] = data["advantages"][list(group)]
        packed.append((lg, batch))
    return packed


def batch_rows_with_tokens(data):
    return int(data["loss_mask"].bool().any(-1).sum())


@pytest.mark.parametrize("spans", [False, True], ids=["one-span", "multi-span"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_packed_micro_batches_give_the_padded_loss_metrics_and_gradient(name, spans):
    """Rows packed three to a micro-batch (and one micro-batch of nothing but padding): the same loss, metrics,
    normalisers (sequences, not rows, are counted) and logits gradient as the padded micro-batches."""
    logits, data = make_batch(spans=spans)
    hook = PolicyLossHook(
        build_policy_loss(LOSSES[name]), {"name": "tis", "cap": 2.0}, tp_group=None, chunk_tokens=7
    )
    want_total, want_metrics, want_grad = run_hook(hook, logits, data, [3, 3])
    groups = [[0, 1, 2], [3, 4, 5], []]
    packed = pack_rows(logits, data, groups)
    batches = add_global_normalisers([b for _, b in packed], dp_group=None)
    assert float(batches[0]["num_sequences_global"]) == 5  # the last row is all prompt
    total, sums, grads = 0.0, {}, []
    for (lg, _), batch in zip(packed, batches):
        leaf = lg.clone().requires_grad_()
        loss, metrics = hook(leaf * 1.0, batch)
        loss.backward()
        total += float(loss.detach())
        grads.append(leaf.grad[0])
        for metric, pair in metrics.items():
            sums[metric] = sums.get(metric, 0) + pair.double()
    assert total == pytest.approx(want_total, rel=1e-6, abs=1e-8)
    assert set(sums) == set(want_metrics)
    for metric, pair in sums.items():
        assert float(pair[0] / pair[1].clamp(min=1e-12)) == pytest.approx(
            want_metrics[metric], rel=1e-6, abs=1e-7
        )
    seq = logits.shape[1]
    for grad, group in zip(grads, groups):
        for slot, row in enumerate(group):
            torch.testing.assert_close(
                grad[slot * seq : (slot + 1) * seq], want_grad[row], atol=1e-8, rtol=1e-6
            )
        assert (grad[len(group) * seq :] == 0).all()  # padding gets no gradient


def test_distillation_kl_at_temperature_one_ratio_collection_and_the_unit_temperature_output():
    """At rollout temperature 0.7 the hook's student–teacher k3 (SAF's warm-up signal) uses the temperature-1
    log-probs teachers score at; the hook keeps each call's token ratios for the step's quantiles."""
    logits, data = make_batch()
    mask = data["loss_mask"].bool()
    logp_t1, _ = naive_logp(logits, data["labels"])
    logp_hot, _ = naive_logp(logits, data["labels"], temperature=0.7)
    teacher = logp_t1 - 0.4
    batch = add_global_normalisers([{**data, "teacher_logp": teacher}], dp_group=None)[0]
    hook = PolicyLossHook({"name": "sapo"}, tp_group=None, temperature=0.7)
    _, metrics = hook(logits.clone(), batch)
    d = (teacher - logp_t1)[mask].double()  # 0.4 below everywhere: k3 = e^-0.4 + 0.4 − 1
    pair = metrics["opd/student_teacher_k3"]
    assert float(pair[0] / pair[1]) == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)
    assert float(pair[0] / pair[1]) == pytest.approx(math.exp(-0.4) + 0.4 - 1, rel=1e-4)
    (ratios,) = hook.take_ratios()
    torch.testing.assert_close(ratios, (logp_hot - data["old_logp"])[mask].exp(), atol=1e-5, rtol=1e-5)
    assert hook.take_ratios() == []  # taken once per step
    _, without = PolicyLossHook({"name": "sapo"}, tp_group=None)(
        logits.clone(), add_global_normalisers([data], dp_group=None)[0]
    )
    assert "opd/student_teacher_k3" not in without  # only when distilling
    both = LogprobOutput(tp_group=None, temperature=0.7, with_unit_temperature=True)(logits, data)
    torch.testing.assert_close(both[0], logp_hot, atol=2e-5, rtol=0)
    torch.testing.assert_close(both[1], logp_t1, atol=2e-5, rtol=0)


def test_loglinear_proximal_needs_no_old_policy_pass():
    """``proximal_logp="loglinear"``: the hook interpolates the proximal log-probs from the engine's and the current
    ones by each token's staleness – the same loss as the algo loss given that approximation as ``old_logp`` –
    and reads no ``old_logp``; staleness 0 everywhere makes the proximal policy the behaviour policy."""
    from sapo_megatron.algo.decoupled import loglinear_proximal_logp

    logits, data = make_batch(seed=3)
    mask = data["loss_mask"].bool()
    staleness = torch.where(mask, torch.arange(12).remainder(3).float().expand(6, 12), 0.0)
    data = {**data, "staleness": staleness}
    del data["old_logp"]
    loss_cfg = build_policy_loss({"name": "sapo"})
    hook = PolicyLossHook(loss_cfg, {"name": "tis", "cap": 2.0}, tp_group=None, proximal_logp="loglinear")

    leaf = logits.clone().requires_grad_()
    logp, _ = naive_logp(leaf, data["labels"])
    proximal = loglinear_proximal_logp(torch.nan_to_num(data["rollout_logp"]), logp, staleness)
    ref_loss, _ = loss_cfg.compute(
        logp,
        proximal,
        data["advantages"],
        mask,
        rollout_logp_bt=data["rollout_logp"],
        correction=TIS(cap=2.0),
    )
    ref_loss.backward()
    total, reduced, grad = run_hook(hook, logits, data, [2, 4])
    assert total == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, leaf.grad, atol=1e-7, rtol=1e-5)
    assert reduced["mismatch/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # stale tokens: π_prox ≠ π_b

    _, on_policy, _ = run_hook(hook, logits, {**data, "staleness": torch.zeros(6, 12)}, [6])
    assert on_policy["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)  # π_prox = π_b
    with pytest.raises(ValueError, match="recompute or loglinear"):
        PolicyLossHook(loss_cfg, proximal_logp="exact")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batch_normalised_rollout_corr_uses_the_whole_batch_mean(level, layout):
    """``is_batch_normalize``: the step's mean (global_is_weight_mean over every micro-batch, padded or packed)
    makes the micro-batches' summed loss and gradient those of the whole batch; each micro-batch normalising over
    itself would not."""
    logits, data = make_batch(spans=True)
    data["rollout_logp"] = data["old_logp"] + 6.0 * (
        data["rollout_logp"] - data["old_logp"]
    )  # wider mismatch
    correction = {"name": "rollout_corr", "is_level": level, "is_threshold": 1.2, "is_batch_normalize": True}
    loss_cfg = build_policy_loss({"name": "grpo"})
    hook = PolicyLossHook(loss_cfg, correction, tp_group=None, chunk_tokens=7)
    leaf = logits.clone().requires_grad_()
    logp, _ = naive_logp(leaf, data["labels"])
    want, want_metrics = loss_cfg.compute(
        logp,
        data["old_logp"],
        data["advantages"],
        data["loss_mask"],
        rollout_logp_bt=data["rollout_logp"],
        correction=hook.correction,
    )
    want.backward()
    factor = float(want_metrics["rollout_corr/batch_norm_factor"])
    assert factor != pytest.approx(1.0, abs=1e-2)
    pieces = (
        split(data, logits, [1, 2, 3])
        if layout == "padded"
        else pack_rows(logits, data, [[0, 1], [2, 3, 4, 5]])
    )
    batches = [MicroBatch.of(b) for b in add_global_normalisers([b for _, b in pieces], dp_group=None)]
    mean = global_is_weight_mean(hook.correction, batches, dp_group=None)
    assert float(mean) == pytest.approx(factor, rel=1e-6)
    for normalised in (True, False):
        total = 0.0
        for (lg, _), batch in zip(pieces, batches):
            batch = batch.copy(**({IS_WEIGHT_MEAN_KEY: mean} if normalised else {}))
            loss, _ = hook(lg.clone().contiguous(), batch)
            total += float(loss)
        if normalised:
            assert total == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
        else:  # each micro-batch's own mean: another loss
            assert total != pytest.approx(want.item(), rel=1e-4)


def _dp_is_weight_mean(payload):
    """One data-parallel rank of the two: its part of the batch's rows; the mean over both ranks per correction."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = slice(0, 2) if dist.get_rank() == 0 else slice(2, 6)
    mine = [MicroBatch.of({k: v[rows] for k, v in _wide_mismatch_batch().items()})]
    return [
        float(global_is_weight_mean(_correction(correction), mine, dp_group=dist.group.WORLD))
        for correction in payload
    ]


def _wide_mismatch_batch():
    _, data = make_batch(spans=True)
    data["rollout_logp"] = data["old_logp"] + 6.0 * (data["rollout_logp"] - data["old_logp"])
    return data


def _correction(settings):
    return PolicyLossHook(build_policy_loss({"name": "grpo"}), settings, tp_group=None).correction


@pytest.mark.slow
def test_batch_mean_is_over_every_data_parallel_rank():
    """Two gloo ranks holding different rows (2 and 4): both get the whole batch's mean, not their own, at the
    token and the sequence level."""
    from tests.distributed import run_distributed

    levels = [
        {"name": "rollout_corr", "is_level": level, "is_threshold": 1.2, "is_batch_normalize": True}
        for level in ("token", "sequence")
    ]
    data = _wide_mismatch_batch()
    whole = [
        float(global_is_weight_mean(_correction(c), [MicroBatch.of(data)], dp_group=None)) for c in levels
    ]
    head = [MicroBatch.of({k: v[:2] for k, v in data.items()})]
    for correction, mean in zip(levels, whole):
        assert float(global_is_weight_mean(_correction(correction), head, dp_group=None)) != pytest.approx(
            mean, rel=1e-3
        )  # a rank's own mean differs
    got = run_distributed("tests.loss.test_loss_hook:_dp_is_weight_mean", 2, levels)
    assert got == [pytest.approx(whole, rel=1e-9)] * 2

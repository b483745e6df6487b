"""Fused expert tensors (Qwen3-VL-MoE checkpoints) seen through the mapping table's per-expert names.

A Qwen3-VL-MoE checkpoint stores each MoE layer's experts as two 3-D tensors, in one of two layouts:

=================  ===============================  ==============================  ==========================
layout             ``mlp.experts.gate_up_proj``     ``mlp.experts.down_proj``       written by
=================  ===============================  ==============================  ==========================
``hub``            ``[E, H, 2I]`` (``x @ W``)        ``[E, I, H]``                   the released checkpoints
``transformers``   ``[E, 2I, H]`` (``F.linear``)     ``[E, H, I]``                   transformers 5.x in memory
                                                                                    and its ``save_pretrained``
=================  ===============================  ==============================  ==========================

Gate rows come first (transformers chunks ``gate_up`` in two). The layout is recognised from the *pair* of a
layer's shapes, which is unambiguous even when ``H = 2I`` or ``H = I``: ``transformers`` has
``gate_up[1] = 2·down[2]`` and ``gate_up[2] = down[1]``; ``hub`` has ``gate_up[2] = 2·down[1]`` and
``gate_up[1] = down[2]``; both at once would need ``down[1] = 0``. Per-expert names
(``mlp.experts.{e}.gate_proj.weight`` ...) are read as they are; a checkpoint mixing both forms is refused
(SGLang 0.5.23 refuses it too). Exports write the hub layout, the one SGLang 0.5.23's
``qwen3_vl_moe.load_weights`` reads (it transposes every fused expert tensor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import torch

from sapo_megatron.errors import UserError

Layout = Literal["hub", "transformers"]
FUSED_NAME = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$"
)


class FusedExpertsError(UserError, ValueError):
    """Fused expert tensors that cannot be read: mixed with per-expert ones, unpaired, or of no known layout."""


@dataclass(frozen=True)
class ExpertSlice:
    """One per-expert tensor inside a fused one: ``part`` of expert ``expert`` of ``fused``."""

    fused: str
    expert: int
    part: Literal["gate", "up", "down"]
    layout: Layout
    shape: tuple[int, int]  # the per-expert tensor: [I, H] (gate, up) or [H, I] (down)

    def take(self, slab: torch.Tensor) -> torch.Tensor:
        """The per-expert tensor from ``slab = fused[expert]`` (a contiguous copy)."""
        if self.part == "down":
            return (slab.t() if self.layout == "hub" else slab).contiguous()
        rows = slab.t() if self.layout == "hub" else slab  # [2I, H]
        half = rows.shape[0] // 2
        return (rows[:half] if self.part == "gate" else rows[half:]).contiguous()


def per_expert_view(shapes: Mapping[str, Sequence[int]]) -> dict[str, ExpertSlice]:
    """Per-expert name → where it lives, for every fused expert tensor among ``shapes`` (name → shape).

    Empty when the checkpoint has no fused experts. Raises :class:`FusedExpertsError` naming the tensors when
    fused and per-expert names are mixed, a layer has only one of its two fused tensors, or their shapes fit
    neither layout."""
    fused: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = FUSED_NAME.match(name)
        if match:
            fused.setdefault(match["prefix"], {})[match["kind"]] = tuple(shape)
    if not fused:
        return {}
    per_expert = sorted(n for n in shapes if PER_EXPERT_NAME.match(n))
    if per_expert:
        example = next(iter(fused))
        raise FusedExpertsError(
            f"the checkpoint mixes fused expert tensors (e.g. {example}.gate_up_proj) with per-expert ones "
            f"(e.g. {per_expert[0]}); store every layer's experts one way"
        )
    view: dict[str, ExpertSlice] = {}
    for prefix, pair in sorted(fused.items()):
        view.update(_layer_view(prefix, pair))
    return view


def _layer_view(prefix: str, pair: dict[str, tuple[int, ...]]) -> dict[str, ExpertSlice]:
    if set(pair) != {"gate_up_proj", "down_proj"}:
        missing = ({"gate_up_proj", "down_proj"} - set(pair)).pop()
        raise FusedExpertsError(
            f"{prefix}.{missing} is missing (the layer's other fused expert tensor is there)"
        )
    gate_up, down = pair["gate_up_proj"], pair["down_proj"]
    layout = _layout(gate_up, down)
    if layout is None:
        raise FusedExpertsError(
            f"{prefix}: gate_up_proj {list(gate_up)} and down_proj {list(down)} fit neither the hub layout "
            "([E, H, 2I], [E, I, H]) nor transformers' ([E, 2I, H], [E, H, I])"
        )
    experts = gate_up[0]
    hidden, inter = (gate_up[1], down[1]) if layout == "hub" else (gate_up[2], down[2])
    out = {}
    for e in range(experts):
        for part in ("gate", "up", "down"):
            fused = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
            shape = (hidden, inter) if part == "down" else (inter, hidden)
            out[f"{prefix}.{e}.{part}_proj.weight"] = ExpertSlice(fused, e, part, layout, shape)
    return out


def _layout(gate_up: tuple[int, ...], down: tuple[int, ...]) -> Layout | None:
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        return None
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        return "transformers"
    if gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        return "hub"
    return None


def unfuse(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory tensors (e.g. a transformers model's ``state_dict()``) with fused experts replaced by
    per-expert ones (the mapping table's names)."""
    view = per_expert_view({n: tuple(t.shape) for n, t in tensors.items()})
    fused_names = {s.fused for s in view.values()}
    out = {n: t for n, t in tensors.items() if n not in fused_names}
    out.update({name: s.take(tensors[s.fused][s.expert]) for name, s in view.items()})
    return out


# --------------------------------------------------------------------------------------------------------
# Export: per-expert tensors → hub-layout fused tensors, streaming
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedGroup:
    """The per-expert names of one layer, and the two hub-layout tensors they become."""

    prefix: str
    members: tuple[str, ...]
    experts: int
    hidden: int
    inter: int

    @property
    def gate_up(self) -> tuple[str, tuple[int, int, int]]:
        return f"{self.prefix}.gate_up_proj", (self.experts, self.hidden, 2 * self.inter)

    @property
    def down(self) -> tuple[str, tuple[int, int, int]]:
        return f"{self.prefix}.down_proj", (self.experts, self.inter, self.hidden)

    def fuse(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Hub layout: ``gate_up [E, H, 2I]`` (``[gate; up]ᵀ`` per expert), ``down [E, I, H]``."""
        p = self.prefix
        gate_up = torch.stack(
            [
                torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]).t()
                for e in range(self.experts)
            ]
        )
        down = torch.stack([tensors[f"{p}.{e}.down_proj.weight"].t() for e in range(self.experts)])
        return [(self.gate_up[0], gate_up.contiguous()), (self.down[0], down.contiguous())]


def fused_groups(shapes: Mapping[str, Sequence[int]]) -> list[FusedGroup]:
    """Group per-expert names (name → shape) by layer; every expert ``0..E-1`` must have all three tensors."""
    by_prefix: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = PER_EXPERT_NAME.match(name)
        if match:
            by_prefix.setdefault(match["prefix"], {})[name] = tuple(shape)
    groups = []
    for prefix, members in by_prefix.items():
        experts = len(members) // 3
        inter, hidden = members[f"{prefix}.0.gate_proj.weight"]
        expected = {
            f"{prefix}.{e}.{part}_proj.weight" for e in range(experts) for part in ("gate", "up", "down")
        }
        if set(members) != expected:
            raise FusedExpertsError(
                f"{prefix}: the per-expert tensors are not 3 per expert for experts 0..{experts - 1}"
            )
        groups.append(FusedGroup(prefix, tuple(members), experts, hidden, inter))
    return groups


def fuse_specs(names_and_shapes: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The export's tensor list with each layer's per-expert tensors replaced by its two fused ones, placed
    where the layer's last per-expert tensor was (the order :func:`fuse_stream` yields them in)."""
    groups = fused_groups(dict(names_and_shapes))
    last = {}
    for group in groups:
        positions = [i for i, (n, _) in enumerate(names_and_shapes) if n in set(group.members)]
        last[max(positions)] = group
    members = {n for g in groups for n in g.members}
    out: list[tuple[str, tuple[int, ...]]] = []
    for i, (name, shape) in enumerate(names_and_shapes):
        if i in last:
            out += [last[i].gate_up, last[i].down]
        elif name not in members:
            out.append((name, shape))
    return out


def fuse_stream(
    stream: Iterable[tuple[str, torch.Tensor]], groups: Sequence[FusedGroup]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with each group's per-expert tensors buffered and yielded as its fused pair once the last
    one arrives (memory: one layer's experts)."""
    group_of = {name: g for g in groups for name in g.members}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        group = group_of.get(name)
        if group is None:
            yield name, tensor
            continue
        buffer = pending.setdefault(group.prefix, {})
        buffer[name] = tensor
        if len(buffer) == len(group.members):
            yield from group.fuse(pending.pop(group.prefix))


# --------------------------------------------------------------------------------------------------------
# Load: what transformers leaves untransposed
# --------------------------------------------------------------------------------------------------------


ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def transpose_square_hub_experts(model: ModelT, directory: str | Path) -> ModelT:
    """Put right the fused expert tensors transformers loaded from a hub-layout checkpoint without transposing.

    transformers 5 reads ``qwen3_vl_moe`` fused experts with ``Transpose(1, 2, check_dims=True)``: it transposes a
    tensor only when the file's shape differs from the parameter's. With ``H = I`` (``down_proj``: ``[E, I, H]``
    in the file, ``[E, H, I]`` in memory) or ``H = 2I`` (``gate_up_proj``) both shapes are equal, so the tensor is
    kept as the file holds it – transposed wrong, with no warning (the CPU VL demo's ``H = I = 64`` evaluated a
    different model than it trained). The file's layout is told from the pair of shapes (unambiguous, see above);
    each hub-layout tensor whose shape equals its parameter's is transposed here. Returns ``model``."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = [n for n in f.keys() if FUSED_NAME.match(n)]  # noqa: SIM118 (safe_open is not iterable)
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in names})
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = FUSED_NAME.match(name)
        assert match is not None
        pairs.setdefault(match["prefix"], {})[match["kind"]] = shape
    params = dict(model.named_parameters())
    for prefix, pair in sorted(pairs.items()):
        if (
            set(pair) != {"gate_up_proj", "down_proj"}
            or _layout(pair["gate_up_proj"], pair["down_proj"]) != "hub"
        ):
            continue
        for kind, shape in pair.items():
            param = params.get(f"{prefix}.{kind}")
            if param is not None and tuple(param.shape) == shape:
                with torch.no_grad():
                    param.data = param.data.transpose(1, 2).contiguous()
    return model

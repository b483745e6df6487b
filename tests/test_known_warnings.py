"""Library notices a user cannot act on stay off the console (issue 29, friction 7: a Megatron FutureWarning
reached stderr on every ``--resume``); the same warnings from other code still show."""

from __future__ import annotations

import warnings

from sapo_megatron.runtime.logs import filter_known_warnings

RESUME_NOTICES = [
    ("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
     "megatron.core.dist_checkpointing.strategies.torch"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", "sapo_megatron.megatron.cpu_compat"),
]  # fmt: skip


def test_resume_notices_are_hidden_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        for message, module in RESUME_NOTICES:
            warnings.warn_explicit(message, FutureWarning, f"{module.replace('.', '/')}.py", 1, module=module)
            warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.training")
    assert [(str(w.message), w.filename) for w in caught] == [(m, "mine.py") for m, _ in RESUME_NOTICES]

"""From a reward spec (a registered name or an import path) to a checked callable (stdlib only: workers import it).

An import path is ``path/to/file.py:function`` (relative to the working directory; the file's folder is importable,
as for ``python file.py``) or ``package.module:function``.
verl's ``compute_score`` and TRL's batched rewards are recognised by signature (:mod:`.conventions`). A per-sample
reward of this project is called with the keyword arguments ``response`` and ``label``, plus whichever of ``prompt``,
``source`` and ``metadata`` it declares (all of them with ``**kwargs``), plus ``algorithm.reward_kwargs``. A group
reward (``fn.reward_group = True``) takes one argument, the list of :class:`RewardInput` of a prompt's group.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sapo_megatron.rewards.conventions import (
    GROUP,
    TRL,
    VERL,
    VERL_ARGUMENTS,
    detect_convention,
    parameters,
    takes_var_keyword,
    unfilled_parameters,
    unmatched_message,
)

OPTIONAL_ARGUMENTS = ("prompt", "source", "metadata")
REQUIRED_ARGUMENTS = ("response", "label")


class RewardSpecError(ValueError):
    """The reward named by a spec cannot be used; the message is one line."""


def is_import_path(spec: str) -> bool:
    return ":" in spec


def load_function(spec: str) -> Callable[..., Any]:
    """The function an import path names; :class:`RewardSpecError` saying what is wrong."""
    module_part, _, attribute = spec.rpartition(":")
    if not module_part or not attribute:
        raise RewardSpecError(f"{spec!r} is not 'path/to/file.py:function' or 'package.module:function'")
    if module_part.endswith(".py"):
        module = _load_file(Path(module_part))
    else:
        try:
            module = importlib.import_module(module_part)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            raise RewardSpecError(
                f"cannot import module {module_part!r}: {type(exc).__name__}: {exc}"
            ) from None
    fn = getattr(module, attribute, None)
    if fn is None:
        raise RewardSpecError(f"{module_part} has no attribute {attribute!r}")
    if not callable(fn):
        raise RewardSpecError(f"{module_part}:{attribute} is a {type(fn).__name__}, not a function")
    return fn


def _load_file(path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardSpecError(f"reward file {path} does not exist")
    name = f"sapo_user_reward_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardSpecError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    _importable_folder(path.parent)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a module that exits at import is broken too
        del sys.modules[name]
        what = (
            f"called sys.exit({exc.code!r})"
            if isinstance(exc, SystemExit)
            else f"raised {type(exc).__name__}"
        )
        raise RewardSpecError(f"importing {path} {what}: {exc}") from None
    return module


def _importable_folder(folder: Path) -> None:
    """The reward file's own folder goes first on ``sys.path``, as ``python file.py`` puts it: a reward file
    imports the modules next to it (``from my_helpers import ...``) wherever the run was started."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def absolute_spec(spec: str) -> str:
    """``file.py:fn`` with the file made absolute (workers may run elsewhere); other specs unchanged."""
    module_part, _, attribute = spec.rpartition(":")
    if module_part.endswith(".py"):
        return f"{Path(module_part).expanduser().resolve()}:{attribute}"
    return spec


def check_signature(fn: Callable[..., Any], extra_kwargs: Mapping[str, Any]) -> None:
    """:class:`RewardSpecError` when ``fn`` follows none of the accepted reward shapes
    (:mod:`~sapo_megatron.rewards.conventions`), or cannot be called the way its shape is."""
    convention = detect_convention(fn)
    if convention is None:
        raise RewardSpecError(unmatched_message(fn))
    params = parameters(fn)
    if params is None:
        return  # builtins without a signature: the call will tell
    var_kw = takes_var_keyword(params)
    if convention == GROUP:
        _check_group(params, extra_kwargs)
    elif convention == VERL:
        _check_filled(
            fn,
            params,
            set(VERL_ARGUMENTS),
            extra_kwargs,
            "verl's compute_score gets " + ", ".join(VERL_ARGUMENTS),
        )
    elif convention == TRL:
        for name in ("completion_ids", "trainer_state"):
            if name in params and params[name].default is params[name].empty:
                raise RewardSpecError(
                    f"its argument {name!r} (TRL) has no value here: give it a default, or take **kwargs"
                )
    else:
        _check_native(fn, params, extra_kwargs, var_kw)
    _check_extra(params, extra_kwargs, var_kw)


def _check_group(params: Mapping[str, inspect.Parameter], extra_kwargs: Mapping[str, Any]) -> None:
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional[1:] if p.default is p.empty and p.name not in extra_kwargs]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        raise RewardSpecError("a group reward must take one argument: the list of samples of a group")
    if required:
        raise RewardSpecError(f"group reward argument {required[0].name!r} has no value")


def _check_native(
    fn: Callable[..., Any],
    params: Mapping[str, inspect.Parameter],
    extra_kwargs: Mapping[str, Any],
    var_kw: bool,
) -> None:
    for name in REQUIRED_ARGUMENTS:
        param = params.get(name)
        if (param is None or param.kind is param.POSITIONAL_ONLY) and not var_kw:
            raise RewardSpecError(
                f"it must accept the keyword argument {name!r} (signature: {inspect.signature(fn)}); rewards are "
                "called as fn(response=..., label=..., [prompt=..., source=..., metadata=...])"
            )
    given = set(REQUIRED_ARGUMENTS) | set(OPTIONAL_ARGUMENTS)
    _check_filled(fn, params, given, extra_kwargs, "rewards get response, label, prompt, source, metadata")


def _check_filled(
    fn: Callable[..., Any],
    params: Mapping[str, inspect.Parameter],
    given: set[str],
    extra_kwargs: Mapping[str, Any],
    what: str,
) -> None:
    unfilled = unfilled_parameters(params, given, extra_kwargs)
    if unfilled:
        raise RewardSpecError(
            f"its argument {unfilled[0]!r} would get no value (signature: {inspect.signature(fn)}); {what} "
            "and algorithm.reward_kwargs"
        )


def _check_extra(
    params: Mapping[str, inspect.Parameter], extra_kwargs: Mapping[str, Any], var_kw: bool
) -> None:
    for name in extra_kwargs:
        if name not in params and not var_kw:
            raise RewardSpecError(f"algorithm.reward_kwargs has {name!r}, which the reward does not accept")


def call_arguments(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The optional arguments (``prompt``, ``source``, ``metadata``) that ``fn`` gets."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return OPTIONAL_ARGUMENTS
    return tuple(name for name in OPTIONAL_ARGUMENTS if name in params)

"""The two sides of a check run (:func:`.sandbox.run_checked`), started by ``sandbox_boot.py`` as
``python -I -c SOURCE host|check FDS...`` (stdlib only, any Python 3.8+).

- ``host`` (the solution's uid): loads ``solution.py`` as the module ``solution`` and answers the checker's
  requests – call this, get that attribute, compare, convert – with the results encoded as plain values, or as a
  handle where a result is not one.
- ``check`` (another uid: the host cannot trace, signal or read it): reads the tests from its own pipe, binds
  the solution's names to :class:`Remote` proxies, runs the tests, and writes the verdict on the descriptor that
  only it holds, once, after the tests' last statement.

Why the verdict cannot be forged: the solution's code never runs in the checker. Everything the checker gets from
the host is decoded strictly (:func:`decode`: JSON of ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``complex``, lists, tuples, dicts, sets, handles): no object of the solution's, so no ``__eq__`` of its own, reaches
the tests' comparisons; a handle equals only a handle (the solution compares its own objects) and never a plain
value. Exiting (``sys.exit``, ``os._exit``, ``atexit``), patching ``json`` or anything else in the host, or
killing it, ends or changes the host only: the checker sees a missing reply or an exception and fails the test.
The tests see Python's builtins, not the solution's names that shadow them (``all``, ``len``, ...), and of the
solution's names only the functions and classes it defines: a standard-library module name the tests use as a
module (``math.sqrt``) is the checker's own module (a test that uses ``math`` without importing it gets the real
``math``, never the solution's object named ``math``), and the solution's other globals (imports, constants, instances) are not in the tests' scope
(``import solution`` still reaches them).

Wire: each message is a 4-byte big-endian length and that much JSON, at most :data:`MAX_MESSAGE` bytes.
"""

import builtins
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

MAX_MESSAGE = 16 << 20
_dumps, _loads = json.dumps, json.loads  # taken before a solution's module could replace them
SCALARS = (type(None), bool, int, float, str)
_CONTAINER_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_BASES: tuple[type, ...] = (bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset)
"""The host sends an instance of a subclass of these as its base value."""
UNSAFE_MODULES = {
    "antigravity",
    "this",
    "__hello__",
    "__phello__",
    "idlelib",
    "turtle",
    "turtledemo",
    "tkinter",
}


class ProtocolError(Exception):
    """The host sent something that is not a well-formed reply."""


class SolutionExit(BaseException):
    """The solution raised SystemExit / KeyboardInterrupt / GeneratorExit inside a call: no ``except Exception``
    of a test catches it."""


class SolutionError(Exception):
    """The solution raised an exception that is not one of Python's builtin ones."""


def send(fd: int, message) -> None:
    data = _dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a message of {len(data)} bytes (over {MAX_MESSAGE})")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data) :]


def receive(fd: int):
    size = int.from_bytes(_exactly(fd, 4), "big")
    if size > MAX_MESSAGE:
        raise ProtocolError(f"a message of {size} bytes (over {MAX_MESSAGE})")
    return _loads(_exactly(fd, size))


def _exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise ProtocolError("the solution's process ended")
        data += chunk
    return data


def encode(value: Any, handle: Callable[[Any], list[Any]], depth: int = 0) -> list[Any]:
    """``value`` as tagged JSON: ``["v", scalar]``, ``["b", latin-1 text]``, ``["c", re, im]``, ``["l" | "t" |
    "s" | "f", [items]]``, ``["d", [[key, value], ...]]``; anything else goes to ``handle`` (which returns its
    encoding or raises)."""
    if depth > 100:
        raise ValueError("a value nested over 100 deep")
    kind = type(value)
    if kind in SCALARS:
        return ["v", value]
    if kind is bytes:
        return ["b", value.decode("latin-1")]
    if kind is complex:
        return ["c", value.real, value.imag]
    tag = _CONTAINER_TAGS.get(kind)
    if tag:
        return [tag, [encode(item, handle, depth + 1) for item in value]]
    if kind is dict:
        return ["d", [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]]
    return handle(value)


def decode(message: Any, handle: Callable[[list[Any]], Any], depth: int = 0) -> Any:
    """The inverse of :func:`encode`, strict: anything malformed raises :class:`ProtocolError`; ``["h", id]`` and
    ``["m", name, id]`` go to ``handle``."""
    if depth > 100 or type(message) is not list or not message or type(message[0]) is not str:
        raise ProtocolError(f"not an encoded value: {str(message)[:80]}")
    tag, rest = message[0], message[1:]
    if tag == "v" and len(rest) == 1 and type(rest[0]) in SCALARS:
        return rest[0]
    if tag == "b" and len(rest) == 1 and type(rest[0]) is str:
        return rest[0].encode("latin-1")
    if tag == "c" and len(rest) == 2 and all(type(x) in (int, float) for x in rest):
        return complex(*rest)
    if tag in ("l", "t", "s", "f", "d") and len(rest) == 1 and type(rest[0]) is list:
        if tag == "d":
            if not all(type(pair) is list and len(pair) == 2 for pair in rest[0]):
                raise ProtocolError("a malformed dict")
            return {decode(k, handle, depth + 1): decode(v, handle, depth + 1) for k, v in rest[0]}
        items = [decode(item, handle, depth + 1) for item in rest[0]]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag in ("h", "m"):
        return handle(message)
    raise ProtocolError(f"not an encoded value: {str(message)[:80]}")


# ---------------------------------------------------------------- the solution's side (untrusted by the checker)


def host(requests: int, replies: int, path: str) -> None:
    import importlib.util
    import operator
    import types

    objects = []

    def handle(value):
        if isinstance(value, types.ModuleType):
            objects.append(value)
            return ["m", value.__name__, len(objects) - 1]
        for base in _BASES:  # subclasses as their base value
            if isinstance(value, base):
                return encode(base(value), handle)
        objects.append(value)
        return ["h", len(objects) - 1]

    def resolve(message):
        if type(message[-1]) is not int or not 0 <= message[-1] < len(objects):
            raise ProtocolError("an unknown handle")
        return objects[message[-1]]

    operations: dict[str, Callable[..., Any]] = {
        "eq": operator.eq,
        "lt": operator.lt,
        "le": operator.le,
        "len": len,
        "list": list,
        "getitem": operator.getitem,
        "contains": operator.contains,
        "bool": bool,
        "str": str,
        "repr": repr,
        "int": int,
        "float": float,
        "index": operator.index,
        "setattr": setattr,
        "getattr": getattr,
    }
    while True:
        try:
            request = receive(requests)
        except ProtocolError:
            return
        try:
            if request[0] == "load":
                spec = importlib.util.spec_from_file_location("solution", path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load {path} as a module")
                module = importlib.util.module_from_spec(spec)
                sys.modules["solution"] = module
                with contextlib.suppress(SystemExit):  # a script's exit(): the tests judge the names so far
                    spec.loader.exec_module(module)
                names = {
                    k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))
                }
                reply = [
                    "ok",
                    [
                        [name, _encode_or_handle(value, handle, objects), _defined_here(value)]
                        for name, value in names.items()
                    ],
                ]
            elif request[0] == "call":
                target, args, kwargs = (decode(part, resolve) for part in request[1:4])
                result = target(*args, **kwargs)
                reply = ["ok", encode(result, handle), encode(args, handle)]
            else:
                operands = [decode(part, resolve) for part in request[2:]]
                reply = ["ok", encode(operations[request[1]](*operands), handle)]
        except BaseException as exc:  # the solution's exceptions go to the checker, which decides
            reply = ["raise", type(exc).__name__, str(exc)[:1000]]
        send(replies, reply)


def _defined_here(value: Any) -> bool:
    """A function or class the solution's module defines (what tests call), not a name it imported."""
    import inspect

    return (inspect.isfunction(value) or inspect.isclass(value)) and getattr(
        value, "__module__", None
    ) == "solution"


def _encode_or_handle(value: Any, handle: Callable[[Any], list[Any]], objects: list[Any]) -> list[Any]:
    try:
        return encode(value, handle)
    except (ValueError, RecursionError):  # e.g. a constant nested too deep: the checker gets a handle to it
        objects.append(value)
        return ["h", len(objects) - 1]


# ---------------------------------------------------------------- the checker's side (trusted)


class Remote:
    """An object of the solution's, in the checker: every use is a request to the host."""

    __slots__ = ("_connection", "_id")

    def __init__(self, ident: int, connection) -> None:
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_connection", connection)

    def _op(self, name, *operands):
        return self._connection.request("op", name, self, *operands)

    def __call__(self, *args, **kwargs):
        return self._connection.call(self, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._op("getattr", name)

    def __setattr__(self, name, value):
        self._op("setattr", name, value)

    def __eq__(self, other):
        return bool(self._op("eq", other)) if isinstance(other, Remote) else NotImplemented

    def __ne__(self, other):
        return not self._op("eq", other) if isinstance(other, Remote) else NotImplemented

    def __lt__(self, other):
        return bool(self._op("lt", other)) if isinstance(other, Remote) else NotImplemented

    def __le__(self, other):
        return bool(self._op("le", other)) if isinstance(other, Remote) else NotImplemented

    def __hash__(self):
        return hash(("remote", self._id))

    def __len__(self):
        return _typed(self._op("len"), int)

    def __iter__(self):
        return iter(_typed(self._op("list"), list))

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __contains__(self, item):
        return _typed(self._op("contains", item), bool)

    def __bool__(self):
        return _typed(self._op("bool"), bool)

    def __str__(self):
        return _typed(self._op("str"), str)

    def __repr__(self):
        return _typed(self._op("repr"), str)

    def __int__(self):
        return _typed(self._op("int"), int)

    def __index__(self):
        return _typed(self._op("index"), int)

    def __float__(self):
        return _typed(self._op("float"), float)


def _typed(value, kind):
    if type(value) is not kind:
        raise ProtocolError(
            f"the solution's object gave a {type(value).__name__} where Python needs a {kind}"
        )
    return value


class Connection:
    def __init__(self, requests: int, replies: int) -> None:
        self.requests, self.replies = requests, replies

    def _encode(self, value):
        def handle(item):
            if isinstance(item, Remote) and item._connection is self:
                return ["h", item._id]
            raise TypeError(
                f"a test passed a {type(item).__name__} to the solution, which takes plain values only"
            )

        return encode(value, handle)

    def _decode(self, message):
        def handle(item):
            if item[0] == "h" and len(item) == 2 and type(item[1]) is int:
                return Remote(item[1], self)
            if item[0] == "m" and len(item) == 3 and type(item[1]) is str and type(item[2]) is int:
                return _module(item[1]) or Remote(item[2], self)
            raise ProtocolError("a malformed handle")

        return decode(message, handle)

    def _exchange(self, request):
        send(self.requests, request)
        reply = receive(self.replies)
        if type(reply) is not list or not reply or reply[0] not in ("ok", "raise"):
            raise ProtocolError("a malformed reply")
        if reply[0] == "raise":
            name, text = (str(part) for part in reply[1:3])
            kind = getattr(builtins, name, None)
            # not StopIteration: raised from a call inside map() it would end the iteration early, and
            # all(map(...)) would pass
            if (
                isinstance(kind, type)
                and issubclass(kind, Exception)
                and not issubclass(kind, (StopIteration, StopAsyncIteration))
                and kind.__module__ == "builtins"
            ):
                raise kind(text)
            if name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):
                raise SolutionExit(f"the solution raised {name} ({text})")
            raise SolutionError(f"{name}: {text}")
        return reply

    def load(self) -> tuple[dict, set]:
        """The solution's names, and which of them it defines as functions or classes."""
        reply = self._exchange(["load"])
        if type(reply[1]) is not list:
            raise ProtocolError("a malformed list of names")
        names, defined = {}, set()
        for entry in reply[1]:
            if (
                type(entry) is not list
                or len(entry) != 3
                or type(entry[0]) is not str
                or type(entry[2]) is not bool
            ):
                raise ProtocolError("a malformed name")
            names[entry[0]] = self._decode(entry[1])
            if entry[2]:
                defined.add(entry[0])
        return names, defined

    def call(self, target: Remote, args: tuple, kwargs: dict):
        request = ["call", self._encode(target), self._encode(list(args)), self._encode(kwargs)]
        reply = self._exchange(request)
        if len(reply) != 3:
            raise ProtocolError("a malformed reply to a call")
        after = self._decode(reply[2])
        if type(after) is list and len(after) == len(args):
            for given, changed in zip(args, after):  # the solution changed an argument in place
                if type(given) is list and type(changed) is list:
                    given[:] = changed
                elif type(given) in (dict, set) and type(changed) is type(given):
                    given.clear()
                    given.update(changed)
        return self._decode(reply[1])

    def request(self, *request):
        reply = self._exchange([request[0], request[1], *(self._encode(item) for item in request[2:])])
        return self._decode(reply[1])


def _module(name: str):
    """The checker's own copy of a standard-library module the solution imported (never a module of the
    solution's: the checker imports only from its read-only search path)."""
    import importlib

    top = name.partition(".")[0]
    if top in UNSAFE_MODULES or top not in getattr(sys, "stdlib_module_names", ()):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def check(requests: int, replies: int, tests: int, verdict: int) -> None:
    import ctypes
    import types

    with contextlib.suppress(
        OSError, AttributeError
    ):  # not even the same uid may trace it or read its memory
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    with open(tests, encoding="utf-8") as stream:
        script = stream.read()
    reported: list[Any] = []  # what the tests passed to __report__
    result: dict[str, Any] = {"ok": False}
    try:
        connection = Connection(requests, replies)
        names, defined = connection.load()
        module = types.ModuleType("solution")
        module.__dict__.update(names)
        sys.modules["solution"] = module
        scope = _test_scope(names, defined, _used_as_modules(script))
        scope.update(
            __name__="__main__", __builtins__=builtins, __solution__=module, __report__=reported.append
        )
        exec(compile(script, "<tests>", "exec"), scope)
        result = {"ok": True}
        if reported:
            result["value"] = json.loads(json.dumps(reported[-1], default=_not_a_value))
    except BaseException as exc:  # every way a test can end is a verdict
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(verdict, data) :]
    os.close(verdict)


def _used_as_modules(script: str) -> set:
    """The bare names the tests read an attribute of (``math`` in ``math.sqrt(2)``)."""
    import ast

    try:
        tree = ast.parse(script)
    except SyntaxError:
        return set()
    return {
        node.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }


def _test_scope(names: dict, defined: set, modules: set) -> dict:
    """The solution's names the tests see: a standard-library module name the tests use as a module is the
    checker's own module (whatever the solution bound to it), a function or class the solution defines is its
    proxy, nothing else; never a name that shadows a builtin."""
    scope = {}
    for name, value in names.items():
        if hasattr(builtins, name):
            continue
        own = _module(name) if name in modules or name not in defined else None
        if own is not None:
            scope[name] = own
        elif name in defined:
            scope[name] = value
    return scope


def _not_a_value(value):
    raise TypeError(f"the solution returned a {type(value).__name__} object, not a value")


if __name__ == "__main__":
    if hasattr(
        sys, "set_int_max_str_digits"
    ):  # a right answer may be an int of any length (CPU-bounded here)
        sys.set_int_max_str_digits(0)
    role, *fds = sys.argv[1:]
    if role == "host":
        host(int(fds[0]), int(fds[1]), fds[2])
    else:
        check(*(int(fd) for fd in fds))

"""Lock keys from a task's name and its arguments.

A call is first bound to the task's signature with defaults applied, so
``f(1, 2)``, ``f(1, b=2)``, ``f(a=1, b=2)`` and ``f(1)`` (with ``b=2`` as the
default) are the same call and get the same key. The bound arguments are then
written in a canonical, type-tagged, length-prefixed form and hashed:

* types stay distinct (``1``, ``1.0``, ``"1"`` and ``True`` differ);
* values never collide by concatenation (every string and container carries
  its length);
* the form survives a message round trip: a tuple sent arrives as a list, so
  both encode as a list, and a string's surrogate pair as its code point; an
  int/float Enum member encodes as its number; a mapping's number, boolean and
  ``None`` keys encode as the text JSON makes of them (``{1: x}`` arrives as
  ``{"1": x}``); dict order does not matter;
* UUID, Decimal, datetime/date/time, bytes, sets and nested containers are
  supported; anything else raises :class:`~celery_redislock.errors.KeyDerivationError`.

The resulting lock name is ``<task name>:<32 hex digits>``: the task name stays
readable in Redis, argument values never appear there in clear.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import hashlib
import importlib
import inspect
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from celery_redislock.errors import KeyDerivationError

#: Key material: what ``lock_key`` may be.
KeySource = str | Callable[..., Any]
#: Turns a call's ``(args, kwargs)`` into what a worker receives (see :class:`KeyBuilder`).
Delivered = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


#: Bigger ints are written in hex: decimal conversion of huge ints is capped by
#: ``sys.set_int_max_str_digits`` (never below 640 digits; 2**2048 has 617).
_MAX_DECIMAL_BITS = 2048


class _Hash(Protocol):
    """What the key derivation uses of a hash object."""

    def hexdigest(self) -> str: ...


def _sha256_from(modules: Sequence[str]) -> Callable[[bytes], _Hash]:
    """The first of ``modules`` (CPython's own hash modules) that has ``sha256``,
    else :func:`hashlib.sha256`: the same digest either way.

    hashlib's SHA-256 is OpenSSL's, and OpenSSL 3 sets up each hash through its
    provider machinery: in a worker, whose caches the rest of a task keeps cold,
    that costs about 12 µs more per lock name than CPython's own implementation.
    A build without the latter (one that leaves hashing to OpenSSL alone) uses
    hashlib's.
    """
    for name in modules:
        try:
            function: Callable[[bytes], _Hash] = importlib.import_module(name).sha256
        except (ImportError, AttributeError):
            continue
        return function
    return hashlib.sha256


#: SHA-256 for lock names (``_sha2`` from Python 3.12, ``_sha256`` before).
_sha256 = _sha256_from(("_sha2", "_sha256"))


_TOO_DEEP = (
    "cannot derive a lock key from a value nested this deeply; "
    "key on less with lock_on=(...) or compute the key with lock_key="
)


def _frame(tag: bytes, payload: bytes) -> bytes:
    return b"%s%d:%s" % (tag, len(payload), payload)


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Surrogates. JSON sends "\ud83d\ude00" as an escape pair that arrives
        # as the one code point U+1F600, so pair them up here too; lone ones stay.
        paired = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
        return paired.encode("utf-8", "surrogatepass")


def canonical(value: Any) -> bytes:
    """Encode ``value`` as canonical bytes (see the module docstring).

    Raises:
        KeyDerivationError: ``value`` (or something inside it) has no canonical
            form, contains itself, or is nested too deeply to encode.
    """
    try:
        return _canonical(value, set())
    except RecursionError:
        raise KeyDerivationError(_TOO_DEEP) from None


def _canonical(value: Any, path: set[int]) -> bytes:
    """:func:`canonical`, with ``path`` the ids of the containers being encoded
    around ``value``: meeting one of them again means a value contains itself."""
    # The common exact types first (this runs for every argument of every task).
    kind = type(value)
    if kind is str:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            data = _utf8(value)
        return b"s%d:%s" % (len(data), data)
    if kind is int and value.bit_length() <= _MAX_DECIMAL_BITS:
        data = b"%d" % value
        return b"i%d:%s" % (len(data), data)
    if kind is float:
        data = float.__repr__(value).encode()
        return b"f%d:%s" % (len(data), data)
    # bool before int: True is an int.
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        if value.bit_length() > _MAX_DECIMAL_BITS:
            return _frame(b"I", int.__format__(value, "x").encode())
        # int.__repr__/float.__repr__: the plain number, whatever a subclass (an
        # int or float Enum) prints, as a JSON message carries it.
        return _frame(b"i", int.__repr__(value).encode())
    if isinstance(value, float):
        return _frame(b"f", float.__repr__(value).encode())
    if isinstance(value, str):
        return _frame(b"s", _utf8(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return _frame(b"y", bytes(value))
    if isinstance(value, decimal.Decimal):
        # str() writes the exponent as "e" when the thread's decimal context has
        # capitals=0; the key must not depend on that.
        return _frame(b"D", decimal.Decimal.__str__(value).replace("e", "E").encode())
    if isinstance(value, uuid.UUID):
        return _frame(b"u", value.hex.encode())
    if isinstance(value, datetime.datetime):
        return _frame(b"t", value.isoformat().encode())
    if isinstance(value, datetime.date):
        return _frame(b"a", value.isoformat().encode())
    if isinstance(value, datetime.time):
        return _frame(b"h", value.isoformat().encode())
    if isinstance(value, Mapping | set | frozenset | list | tuple):
        # Only the containers on the path count: the same value twice side by
        # side ([x, x]) is fine, and its form stays what it always was.
        if id(value) in path:
            raise KeyDerivationError(
                f"cannot derive a lock key from a {type(value).__name__} that contains "
                "itself (a recursive value); key on other arguments with lock_on=(...) "
                "or compute the key with lock_key="
            )
        path.add(id(value))
        try:
            return _container(value, path)
        finally:
            path.discard(id(value))
    raise KeyDerivationError(
        f"cannot derive a lock key from a {type(value).__name__} value; "
        "exclude it with lock_on=(...) or compute the key with lock_key="
    )


def _container(value: Any, path: set[int]) -> bytes:
    """The canonical form of a mapping, set, list or tuple."""
    if isinstance(value, Mapping):
        keys = [_as_json_key(k) for k in value]
        if len(set(keys)) < len(keys):
            raise KeyDerivationError(
                "a mapping has two keys that a JSON message carries as the same text "
                f"(e.g. 1 and '1'): {sorted(map(repr, value))}; give them distinct text"
            )
        items = sorted(
            _canonical(k, path) + _canonical(v, path)
            for k, v in zip(keys, value.values(), strict=True)
        )
        return _frame(b"d", b"".join(items))
    if isinstance(value, set | frozenset):
        return _frame(b"e", b"".join(sorted(_canonical(v, path) for v in value)))
    return _frame(b"l", b"".join(_canonical(v, path) for v in value))


def _as_json_key(key: Any) -> Any:
    """A mapping key as a JSON message carries it: JSON object keys are text, so
    a number, a boolean or ``None`` arrives as the text :mod:`json` writes for it
    (``1`` as ``"1"``, ``True`` as ``"true"``). Any other key is left as it is (a
    JSON message cannot carry it at all; pickle carries it unchanged)."""
    if isinstance(key, str):
        return key
    if key is None:
        return "null"
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        try:
            return int.__repr__(key)
        except ValueError:
            # Past Python's limit on the digits of an int written as text
            # (sys.set_int_max_str_digits): no JSON message can carry it either.
            raise KeyDerivationError(
                f"cannot derive a lock key from a mapping keyed by an int of "
                f"{key.bit_length()} bits (too many digits to write as text); "
                "use a shorter key, or compute the key with lock_key="
            ) from None
    if isinstance(key, float):
        if key != key:
            return "NaN"
        if key in (math.inf, -math.inf):
            return "Infinity" if key > 0 else "-Infinity"
        return float.__repr__(key)
    return key


def digest(material: Any) -> str:
    """A 128-bit hex digest of ``material``'s canonical form."""
    return _sha256(canonical(material)).hexdigest()[:32]


def _digest_arguments(arguments: Mapping[str, Any], order: Sequence[tuple[str, bytes]]) -> str:
    """``digest({name: arguments[name] for name, _ in order})``, for ``order`` the
    names with their canonical forms, sorted by those: the entries of a mapping
    with distinct string keys sort as their keys' canonical forms do (no such
    form is a prefix of another), so the sort is done once, not per call."""
    path: set[int] = set()
    try:
        body = b"".join([form + _canonical(arguments[name], path) for name, form in order])
    except RecursionError:
        raise KeyDerivationError(_TOO_DEEP) from None
    return _sha256(b"d%d:%s" % (len(body), body)).hexdigest()[:32]


def _text_digest(values: Sequence[Any], order: Sequence[tuple[int, str]]) -> str | None:
    """What :func:`_digest_arguments` gives for the arguments at the positions of
    ``order`` (with their names' canonical forms, as text), when each of them is
    ASCII text, an ``int`` or a ``float`` (exactly those types): the canonical form
    is then ASCII, so it is built as text and encoded once. ``None`` for any other
    value, which takes the general path."""
    parts = []
    try:
        for position, form in order:
            value = values[position]
            kind = type(value)
            if kind is str:
                if not value.isascii():
                    return None
                parts.append(f"{form}s{_LENGTHS[len(value)]}:{value}")
                continue
            # (str() and repr() of exactly an int or a float are the plain number.)
            if kind is int:
                if value.bit_length() > _MAX_DECIMAL_BITS:
                    return None
                text = str(value)
                parts.append(f"{form}i{_LENGTHS[len(text)]}:{text}")
                continue
            if kind is not float:
                return None
            text = repr(value)
            parts.append(f"{form}f{_LENGTHS[len(text)]}:{text}")
    except IndexError:  # a value longer than the table of lengths
        return None
    body = "".join(parts)
    return _sha256(f"d{len(body)}:{body}".encode()).hexdigest()[:32]


#: The digits of the lengths :func:`_text_digest` writes, ready-made: formatting
#: a number costs several times a lookup.
_LENGTHS = tuple(str(n) for n in range(1024))

#: The types a message's positional arguments come as: a tuple, or a list once
#: decoded from JSON. A tuple made once: ``tuple | list`` in a call's
#: ``isinstance`` makes a union anew on every call, and this runs on every task.
_POSITIONAL = (tuple, list)


def _bare(signature: inspect.Signature) -> str:
    """``signature`` without its annotations, for a message: ``(account_id, full=False)``."""
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=empty))


class KeyBuilder:
    """Derives lock names for one task.

    Arguments:
        task_name: the Celery task name (kept readable in the key).
        signature: the signature of the task's body, which calls are bound to
            (``None``: key on the raw positional and keyword arguments).
        lock_on: parameter names to key on (default: all parameters).
        lock_key: a constant string, or a callable taking the task's arguments
            and returning the key material; overrides ``lock_on``. It is called
            with the arguments by name, defaults applied (those that can only be
            passed by position, by position), so that every spelling of a call
            gives it the same; and as a worker receives them (see ``delivered``).
        delivered: turns a call's arguments into what a worker receives once the
            message has gone through the task's serializer (a tuple becomes a
            list, a ``str`` Enum member its value under JSON). A callable
            ``lock_key`` sees them so on the producer too, so that the key a send
            reserves is the one its execution takes, and sees the defaults so as
            well, so that a default and the same value passed are one call.
            Applied to what a worker received already, it changes nothing.

    Raises:
        ValueError: ``lock_on`` names a parameter the task does not have, or
            ``lock_key`` cannot take the task's arguments by name (those its
            ``*args`` and ``**kwargs`` receive included).
    """

    def __init__(
        self,
        task_name: str,
        signature: inspect.Signature | None,
        lock_on: Sequence[str] | None = None,
        lock_key: KeySource | None = None,
        delivered: Delivered | None = None,
    ) -> None:
        self.task_name = task_name
        self.lock_key = lock_key
        self.delivered = delivered
        self.signature = signature
        self.lock_on = tuple(lock_on) if lock_on is not None else None
        #: Parameter names and defaults when every parameter is a plain
        #: positional-or-keyword one: calls are then bound without inspect.
        self._plain: tuple[tuple[str, Any], ...] | None = None
        if signature is not None and all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values()
        ):
            self._plain = tuple((p.name, p.default) for p in signature.parameters.values())
        if self.lock_on is not None and self.signature is not None:
            unknown = [n for n in self.lock_on if n not in self.signature.parameters]
            if unknown:
                raise ValueError(
                    f"lock_on names {', '.join(map(repr, unknown))}, which "
                    f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                    f"of task {task_name!r} (parameters: {list(self.signature.parameters)})"
                )
        if callable(lock_key) and signature is not None:
            _check_takes(lock_key, signature, task_name)
        #: With ``_plain`` and no ``lock_key``: the names the key is made of, with
        #: their canonical forms, in the order the material's entries sort in.
        self._order: tuple[tuple[str, bytes], ...] | None = None
        #: With ``_order``, when the names' forms are ASCII: the same by position
        #: in a call passing every parameter positionally (the usual Celery
        #: message), with the forms as text; and how many parameters that is
        #: (-1: no such path).
        self._positions: tuple[tuple[int, str], ...] = ()
        self._arity = -1
        if self._plain is not None and lock_key is None:
            names = self.lock_on if self.lock_on is not None else [n for n, _ in self._plain]
            forms = {name: canonical(name) for name in names}
            self._order = tuple(sorted(forms.items(), key=lambda entry: entry[1]))
            if all(form.isascii() for _, form in self._order):
                positions = {name: index for index, (name, _) in enumerate(self._plain)}
                self._positions = tuple((positions[n], form.decode()) for n, form in self._order)
                self._arity = len(self._plain)

    def material(self, args: Iterable[Any], kwargs: Mapping[str, Any]) -> Any:
        """The values the key is made of, for one call."""
        args, kwargs = tuple(args), dict(kwargs)
        if isinstance(self.lock_key, str):
            return self.lock_key
        if self.lock_key is not None:
            return self._from_lock_key(self.lock_key, args, kwargs)
        if self.signature is None:
            return [list(args), kwargs]
        arguments = self._bind_plain(args, kwargs)
        if arguments is not None:
            return self._chosen(arguments)
        return self._chosen(dict(self._bind(args, kwargs).arguments))

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """A call bound to the task's signature, with defaults applied."""
        assert self.signature is not None
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KeyDerivationError(
                f"the arguments do not fit task {self.task_name!r}, whose body takes "
                f"{_bare(self.signature)}: {exc}"
            ) from exc
        bound.apply_defaults()
        return bound

    def _from_lock_key(
        self, lock_key: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """What a callable ``lock_key`` returns for a call, given the arguments by
        name and with defaults applied, as a worker receives them.

        The defaults are applied before the serializer's round trip, so that they
        go through it as a value passed does: ``f(1)`` and ``f(1, Mode.FULL)``
        (``Mode.FULL`` the default, a ``str`` Enum member that JSON delivers as its
        value) give the callable the same. On a worker, whose values have been
        through the round trip already, it changes nothing: both sides agree.
        """
        given_args, given_kwargs = args, kwargs
        if self.signature is not None:
            args, kwargs = self._by_name(args, kwargs)
        if self.delivered is not None:
            args, kwargs = self._as_delivered(
                self.delivered, given_args, given_kwargs, args, kwargs
            )
        try:
            return lock_key(*args, **kwargs)
        except Exception as exc:
            raise KeyDerivationError(
                f"lock_key of task {self.task_name!r} raised {type(exc).__name__}: {exc}"
            ) from exc

    @staticmethod
    def _as_delivered(
        delivered: Delivered,
        given_args: tuple[Any, ...],
        given_kwargs: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` (a call given as ``given_args`` and
        ``given_kwargs``, bound with defaults applied) as a worker receives them."""
        with contextlib.suppress(Exception):
            return delivered(args, kwargs)
        try:
            delivered(given_args, given_kwargs)
        except Exception:
            # A value the serializer refuses never reaches a worker: the call is
            # only run in the caller's process (apply()), which sees it as it is.
            return args, kwargs
        # A default the serializer refuses (a sentinel object()) is the same object
        # on both sides: leave it as it is, and put each other value through alone.

        def one(value: Any) -> Any:
            try:
                return delivered((value,), {})[0][0]
            except Exception:
                return value

        return tuple(map(one, args)), {name: one(value) for name, value in kwargs.items()}

    def _by_name(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call spelled one way whatever way it came: every argument by name,
        defaults applied, but those only a position can take (positional-only
        parameters, ``*args`` and those before it)."""
        assert self.signature is not None
        arguments = self._bind_plain(args, kwargs)
        if arguments is not None:
            return (), arguments
        bound = self._bind(args, kwargs)
        kinds = [p.kind for p in self.signature.parameters.values()]
        if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.POSITIONAL_ONLY in kinds:
            return bound.args, bound.kwargs
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        return (), named

    def _chosen(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The bound arguments the key is made of (``lock_on``'s, or all)."""
        if self.lock_on is not None:
            return {name: arguments[name] for name in self.lock_on}
        return arguments

    def _bind_plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """What ``signature.bind()`` + ``apply_defaults()`` give, for a signature of
        plain parameters; ``None`` when the call needs the general path (or is
        invalid, so that ``bind`` says why)."""
        plain = self._plain
        if plain is None or len(args) > len(plain):
            return None
        arguments: dict[str, Any] = {}
        used = 0
        for index, (name, default) in enumerate(plain):
            if index < len(args):
                if name in kwargs:
                    return None
                arguments[name] = args[index]
            elif name in kwargs:
                arguments[name] = kwargs[name]
                used += 1
            elif default is not inspect.Parameter.empty:
                arguments[name] = default
            else:
                return None
        return arguments if used == len(kwargs) else None

    def __call__(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The lock name for a call: ``<task name>:<digest of the material>``.

        Raises:
            KeyDerivationError: the arguments do not fit the signature, or a value
                has no canonical form; the message names the argument (or
                ``lock_key``) it came from.
        """
        if self._order is not None:
            # A message's arguments are a tuple, or a list once decoded from JSON.
            if not kwargs and isinstance(args, _POSITIONAL) and len(args) == self._arity:
                found = _text_digest(args, self._positions)
                if found is not None:
                    return f"{self.task_name}:{found}"
            arguments = self._bind_plain(tuple(args or ()), dict(kwargs or {}))
            if arguments is not None:
                try:
                    return f"{self.task_name}:{_digest_arguments(arguments, self._order)}"
                except KeyDerivationError as exc:
                    material = self._chosen(arguments)
                    raise KeyDerivationError(f"{self._culprit(material)}: {exc}") from exc
        material = self.material(args or (), kwargs or {})
        try:
            return f"{self.task_name}:{digest(material)}"
        except KeyDerivationError as exc:
            raise KeyDerivationError(f"{self._culprit(material)}: {exc}") from exc

    def _culprit(self, material: Any) -> str:
        """Which argument (or ``lock_key``) the material that has no key came from."""
        where = f"task {self.task_name!r}"
        if self.lock_key is not None:
            return f"the value lock_key returned for {where}"
        if self.signature is None:
            args, kwargs = material
            named = [(f"positional argument {i}", v) for i, v in enumerate(args)]
            named += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        else:
            named = [(f"argument {k!r}", v) for k, v in material.items()]
        for label, value in named:
            try:
                canonical(value)
            except KeyDerivationError:
                return f"{label} of {where}"
        return f"the arguments of {where}"  # pragma: no cover - one of them failed


def _check_takes(lock_key: Callable[..., Any], signature: inspect.Signature, task: str) -> None:
    """Raise ``ValueError`` if ``lock_key`` cannot be called with the arguments of
    ``signature`` as :meth:`KeyBuilder._by_name` passes them, whatever its
    ``*args`` and ``**kwargs`` receive."""
    try:
        takes = inspect.signature(lock_key)
    except (TypeError, ValueError):
        return  # a callable without a signature to read (some builtins)
    parameters = list(signature.parameters.values())
    by_position = any(
        p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )
    args = [p.name for p in parameters if by_position and p.kind <= p.POSITIONAL_OR_KEYWORD]
    kwargs = {
        p.name: p.name
        for p in parameters
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in args
    }
    try:
        takes.bind(*args, **kwargs)
    except TypeError as exc:
        given = [*args, *(f"{name}=" for name in kwargs)]
        raise ValueError(
            f"lock_key of task {task!r} cannot take the task's arguments, which it is "
            f"given by name with defaults applied ({', '.join(given) or 'none'}): {exc}; "
            "take the ones it needs and **_ for the rest"
        ) from exc
    # The values a task's *args or **kwargs receives come on top of those, under
    # names and in numbers no fixed parameter list can take.
    kinds = {p.kind for p in takes.parameters.values()}
    for kind, stars, extra, given_as in (
        (inspect.Parameter.VAR_POSITIONAL, "*", "positional", "by position"),
        (inspect.Parameter.VAR_KEYWORD, "**", "keyword", "by name"),
    ):
        var = next((p.name for p in parameters if p.kind is kind), None)
        if var is not None and kind not in kinds:
            raise ValueError(
                f"lock_key of task {task!r} cannot take the extra {extra} arguments "
                f"the task's {stars}{var} receives, which it is given {given_as}; "
                f"add {stars}_ to its parameters"
            )

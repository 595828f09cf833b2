"""Tests for lock-key derivation: canonical form, call binding, round trips, errors."""

from __future__ import annotations

import decimal
import enum
import hashlib
import importlib.util
import inspect
import pickle
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import serialization
from kombu.utils import json as kombu_json

from celery_redislock import KeyDerivationError, SingletonTask
from celery_redislock.keys import KeyBuilder, _sha256, _sha256_from, _text_digest, canonical, digest

# No deadline: the suite shares two cores with Redis servers and workers.
KEYS_SETTINGS = settings(
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

KEY_RE = re.compile(r"(?P<task>.+):(?P<digest>[0-9a-f]{32})")


# Sample task bodies; only their signatures matter.
def sample(a: Any, b: Any = 2) -> None:
    """A body with a required and a defaulted parameter."""


def sample_varargs(a: Any, *rest: Any, flag: bool = False, **extra: Any) -> None:
    """A body with every kind of parameter."""


def any_args(*args: Any, **kwargs: Any) -> None:
    """A body that accepts anything, as a message may carry it."""


class Opaque:
    """A plain class with no canonical form."""


@pytest.fixture
def app() -> Iterator[Celery]:
    """A Celery app that never connects: ``lock_name`` does not touch Redis."""
    app = Celery("t", set_as_current=False)
    app.conf.redislock_url = "redis://127.0.0.1:1/0"
    yield app
    app.close()


def json_round_trip(value: Any) -> Any:
    """``value`` after kombu's JSON encoding and decoding, as a message body travels."""
    return kombu_json.loads(kombu_json.dumps(value))  # type: ignore[no-untyped-call]


def rebuilt_in_reverse(items: set[Any] | frozenset[Any]) -> set[Any]:
    """A set of the same elements, inserted in reverse iteration order."""
    copy: set[Any] = set()
    for item in reversed(list(items)):
        copy.add(item)
    return copy


def equivalent_calls() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Four spellings of ``sample(1, 2)``."""
    return [((1, 2), {}), ((1,), {"b": 2}), ((), {"a": 1, "b": 2}), ((1,), {})]


# Strategies.
#: UTC offsets in whole seconds, as real zones have (local mean times included).
#: CPython's fromisoformat drops a sub-second offset smaller than one second, so
#: such a datetime would arrive changed, whatever the key did.
OFFSETS = st.integers(-86_399, 86_399).map(lambda s: timedelta(seconds=s))
TIMEZONES = st.builds(timezone, OFFSETS)
TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)

#: Every scalar type the key supports and both JSON and kombu's encoder carry.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    TEXT,
    st.text(max_size=8).map(str.encode),  # bytes that are valid UTF-8
    st.binary(max_size=8),  # mostly not: sent as base64
    st.uuids(),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.datetimes(),
    st.datetimes(timezones=TIMEZONES),
    st.dates(),
    st.times(timezones=st.none() | TIMEZONES),
)

#: Dict keys. kombu decodes a dict whose keys are exactly ``__type__`` and
#: ``__value__`` as a typed value, whatever the sender meant: keep clear of that.
#: JSON sends the others as text (``1`` as ``"1"``).
DICT_KEYS = st.one_of(
    st.text(max_size=8).filter(lambda k: not k.startswith("__")),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
)


def dictionaries(values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[Any, Any]]:
    """Dicts of :data:`DICT_KEYS` that JSON can carry whole: no two keys with the
    same text (``1`` and ``"1"`` would arrive as one)."""
    return st.dictionaries(DICT_KEYS, values, max_size=4).filter(
        lambda d: len(json_round_trip(dict.fromkeys(d, 0))) == len(d)
    )


JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        dictionaries(children),
    ),
    max_leaves=16,
)

#: Pickle also carries sets, frozensets and bytearrays.
PICKLE_VALUES = st.recursive(
    SCALARS | st.binary(max_size=8).map(bytearray),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        dictionaries(children),
        st.sets(SCALARS, max_size=4),
        st.frozensets(SCALARS, max_size=4),
    ),
    max_leaves=16,
)

KWARG_NAMES = st.text("abcdefgh", min_size=1, max_size=4).map(lambda s: f"k_{s}")

#: A small domain, so that two independent draws are often equal or nearly so.
SMALL_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1, 2),
    st.sampled_from([0.0, -0.0, 1.0, 2.0]),
    st.text("ab", max_size=2),
    st.binary(max_size=2),
    st.sampled_from([Decimal("1"), Decimal("1.0"), Decimal("-0"), Decimal("1E+1")]),
    st.sampled_from([uuid.UUID(int=0), uuid.UUID(int=1)]),
    st.sampled_from([date(2020, 1, 1), date(2020, 1, 2)]),
    st.sampled_from(
        [
            datetime(2020, 1, 1),
            datetime(2020, 1, 1, tzinfo=timezone.utc),
            datetime(2020, 1, 1, 1, tzinfo=timezone(timedelta(hours=1))),
        ]
    ),
    st.sampled_from([time(0, 0), time(0, 0, tzinfo=timezone.utc)]),
)
SMALL_VALUES = st.recursive(
    SMALL_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("ab", max_size=2), children, max_size=2),
        st.frozensets(SMALL_SCALARS, max_size=3),
    ),
    max_leaves=6,
)


def normalize(value: Any) -> Any:
    """A type-strict, hashable model of ``value`` for comparing what keys should tell apart.

    Tuples and lists are the same sequence (a tuple arrives as a list after a
    JSON round trip), and so are a surrogate pair and its code point (JSON joins
    them); ``1``, ``1.0``, ``True`` and ``Decimal("1")`` all differ,
    as do ``0.0`` and ``-0.0``; an aware datetime is its wall time and offset.
    """
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, str):
        return ("str", pair_surrogates(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return ("bytes", bytes(value))
    if isinstance(value, Decimal):
        return ("decimal", value.as_tuple())
    if isinstance(value, uuid.UUID):
        return ("uuid", value.int)
    if isinstance(value, datetime):
        return ("datetime", value.replace(tzinfo=None, fold=0), value.utcoffset())
    if isinstance(value, date):
        return ("date", value)
    if isinstance(value, time):
        return ("time", value.replace(tzinfo=None, fold=0), value.utcoffset())
    if isinstance(value, dict):
        return ("dict", frozenset((normalize(k), normalize(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return ("set", frozenset(normalize(v) for v in value))
    if isinstance(value, list | tuple):
        return ("list", tuple(normalize(v) for v in value))
    raise AssertionError(f"no model for {type(value).__name__}")


def pair_surrogates(text: str) -> str:
    """``text`` with each high+low surrogate pair joined into its code point, as JSON does."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def swap_sequences(value: Any) -> Any:
    """``value`` with every list turned into a tuple and every tuple into a list."""
    if isinstance(value, list):
        return tuple(swap_sequences(v) for v in value)
    if isinstance(value, tuple):
        return [swap_sequences(v) for v in value]
    if isinstance(value, dict):
        return {k: swap_sequences(v) for k, v in value.items()}
    return value


def reorder(value: Any) -> Any:
    """``value`` with every dict and set rebuilt in reverse insertion order."""
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, frozenset):
        return frozenset(rebuilt_in_reverse(value))
    if isinstance(value, set):
        return rebuilt_in_reverse(value)
    if isinstance(value, list):
        return [reorder(v) for v in value]
    if isinstance(value, tuple):
        return tuple(reorder(v) for v in value)
    return value


# Binding calls to the signature.
def test_equivalent_calls_share_a_key() -> None:
    """``f(1, 2)``, ``f(1, b=2)``, ``f(a=1, b=2)`` and ``f(1)`` (default ``b=2``) get one key."""
    builder = KeyBuilder("t.sample", inspect.signature(sample))
    keys = {builder(args, kwargs) for args, kwargs in equivalent_calls()}
    assert len(keys) == 1
    assert builder((1, 3), {}) not in keys


def test_missing_args_and_kwargs_mean_an_empty_call() -> None:
    """``None`` args/kwargs (as Celery passes them) are the same call as empty ones."""
    builder = KeyBuilder("t.any", inspect.signature(any_args))
    assert builder(None, None) == builder((), {})


def test_varargs_and_var_keywords_bind() -> None:
    """With ``*rest``/``**extra`` defaults apply, and keyword order does not matter."""
    builder = KeyBuilder("t.varargs", inspect.signature(sample_varargs))
    assert builder((1, 2, 3), {}) == builder((1, 2, 3), {"flag": False})
    assert builder((1,), {"x": 1, "y": 2}) == builder((1,), {"y": 2, "x": 1})
    assert builder((), {"a": 1}) == builder((1,), {})
    assert builder((1, 2, 3), {}) != builder((1, (2, 3)), {})
    assert builder((1, 2), {}) != builder((1,), {"rest": 2})


def test_no_signature_keys_on_raw_arguments() -> None:
    """Without a signature the key is made of the positional and keyword arguments as sent."""
    builder = KeyBuilder("t.raw", None)
    assert builder((1, 2), {}) == builder([1, 2], {})
    assert builder((1, 2), {}) != builder((1,), {"b": 2})
    assert builder((), {"x": 1, "y": 2}) == builder((), {"y": 2, "x": 1})


def test_plain_task_key_matches_key_builder(app: Celery) -> None:
    """A plain task's ``lock_name`` binds calls like ``KeyBuilder`` with the body's signature."""

    @app.task(base=SingletonTask, shared=False, name="t.sample")
    def plain(a: Any, b: Any = 2) -> None:
        """Sample body."""

    reference = KeyBuilder("t.sample", inspect.signature(sample))((1, 2), {})
    assert {plain.lock_name(args, kwargs) for args, kwargs in equivalent_calls()} == {reference}


def test_bound_task_key_leaves_self_out(app: Celery) -> None:
    """A ``bind=True`` task binds calls to its body without ``self``: same keys as a plain body."""

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.sample")
    def bound(self: Any, a: Any, b: Any = 2) -> None:
        """Sample body."""

    reference = KeyBuilder("t.sample", inspect.signature(sample))((1, 2), {})
    assert {bound.lock_name(args, kwargs) for args, kwargs in equivalent_calls()} == {reference}


@pytest.mark.parametrize("bind", [False, True], ids=["plain", "bound"])
def test_varargs_task_key(app: Celery, bind: bool) -> None:
    """A task with ``*args``/``**kwargs`` applies defaults and ignores keyword order."""
    if bind:

        @app.task(base=SingletonTask, shared=False, bind=True, name="t.varargs")
        def task(self: Any, a: Any, *rest: Any, flag: bool = False, **extra: Any) -> None:
            """Sample body."""

    else:

        @app.task(base=SingletonTask, shared=False, name="t.varargs")
        def task(a: Any, *rest: Any, flag: bool = False, **extra: Any) -> None:
            """Sample body."""

    reference = KeyBuilder("t.varargs", inspect.signature(sample_varargs))
    assert task.lock_name((1, 2), {"x": 1, "y": 2}) == reference((1, 2), {"y": 2, "x": 1})
    assert task.lock_name((1, 2), None) == task.lock_name([1, 2], {"flag": False})
    assert task.lock_name((1, 2), None) != task.lock_name((1, 2), {"flag": True})


def test_key_builder_and_task_agree_on_json_round_trip(app: Celery) -> None:
    """The key a client computes from a call equals the worker's after the JSON message trip."""

    @app.task(base=SingletonTask, shared=False)
    def report(account: Any, since: Any = None, tags: Any = ()) -> None:
        """Sample body."""

    args = (uuid.UUID(int=7), datetime(2024, 5, 1, 12, tzinfo=timezone.utc))
    kwargs = {"tags": ("a", "b")}
    sent_args, sent_kwargs = json_round_trip([args, kwargs])
    assert sent_kwargs == {"tags": ["a", "b"]}
    assert report.lock_name(sent_args, sent_kwargs) == report.lock_name(args, kwargs)


# Message round trips.
@KEYS_SETTINGS
@given(value=JSON_VALUES)
def test_canonical_survives_json_round_trip(value: Any) -> None:
    """A value's canonical form is unchanged by kombu's JSON encoding (a tuple arrives as a list)."""
    assert canonical(json_round_trip(value)) == canonical(value)


@KEYS_SETTINGS
@given(
    args=st.lists(JSON_VALUES, max_size=4).map(tuple),
    kwargs=st.dictionaries(KWARG_NAMES, JSON_VALUES, max_size=3),
)
def test_key_survives_json_message_round_trip(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A call's key is the same before and after its ``[args, kwargs]`` body goes through JSON."""
    builder = KeyBuilder("t.any", inspect.signature(any_args))
    sent_args, sent_kwargs = json_round_trip([args, kwargs])
    assert builder(sent_args, sent_kwargs) == builder(args, kwargs)


@KEYS_SETTINGS
@given(value=PICKLE_VALUES)
def test_canonical_survives_pickle_round_trip(value: Any) -> None:
    """A value's canonical form is unchanged by a pickle round trip (sets included)."""
    assert canonical(pickle.loads(pickle.dumps(value))) == canonical(value)


@KEYS_SETTINGS
@given(
    args=st.lists(PICKLE_VALUES, max_size=4).map(tuple),
    kwargs=st.dictionaries(KWARG_NAMES, PICKLE_VALUES, max_size=3),
)
def test_key_survives_pickle_message_round_trip(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A call's key is the same before and after its body goes through pickle."""
    builder = KeyBuilder("t.any", inspect.signature(any_args))
    sent_args, sent_kwargs = pickle.loads(pickle.dumps((args, kwargs)))
    assert builder(sent_args, sent_kwargs) == builder(args, kwargs)


class Colour(int, enum.Enum):
    """An int Enum whose ``str()`` is ``Colour.RED``, not ``1``."""

    RED = 1


class Ratio(float, enum.Enum):
    """A float Enum whose ``repr()`` is not the number."""

    HALF = 0.5


class Priority(enum.IntEnum):
    """An IntEnum."""

    HIGH = 1


class Mode(str, enum.Enum):
    """A str Enum."""

    FAST = "fast"


@pytest.mark.parametrize(
    ("member", "plain"),
    [(Colour.RED, 1), (Ratio.HALF, 0.5), (Priority.HIGH, 1), (Mode.FAST, "fast")],
    ids=["int-enum", "float-enum", "intenum", "str-enum"],
)
def test_enum_members_key_like_their_value(member: enum.Enum, plain: Any) -> None:
    """An int/float/str Enum member keys as its value, as JSON sends it, so the key survives the trip."""
    assert canonical(member) == canonical(plain)
    assert canonical(json_round_trip([member])[0]) == canonical(member)


def test_surrogate_pairs_key_like_the_code_point_json_delivers() -> None:
    """A string holding a surrogate pair keys like the code point JSON delivers; lone surrogates still key."""
    split = "smile \ud83d\ude00"
    assert json_round_trip(split) == "smile \U0001f600"
    assert canonical(split) == canonical("smile \U0001f600")
    assert canonical(json_round_trip(split)) == canonical(split)
    lone = ["\ud83d", "\ude00", "\ude00\ud83d"]
    assert [json_round_trip(s) for s in lone] == lone
    assert len({canonical(s) for s in [*lone, split]}) == len(lone) + 1


def test_a_mapping_keyed_by_an_int_past_the_digit_limit_fails_clearly() -> None:
    """A JSON message carries an int mapping key as its digits, which Python
    refuses to write past its digit limit (as Celery's send does): the derivation
    raises ``KeyDerivationError`` saying so, not a bare ``ValueError``."""
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(640)
        with pytest.raises(KeyDerivationError, match=r"int of 2326 bits .* lock_key="):
            canonical({10**700: "v"})
    finally:
        sys.set_int_max_str_digits(limit)


def test_huge_ints_have_a_key_whatever_the_digit_limit() -> None:
    """Ints beyond Python's int-to-str digit limit still key, identically under any limit."""
    huge = 10**5000
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(640)
        capped = (canonical(huge), canonical(10**700), canonical(2**2048))
        sys.set_int_max_str_digits(0)
        uncapped = (canonical(huge), canonical(10**700), canonical(2**2048))
    finally:
        sys.set_int_max_str_digits(limit)
    assert capped == uncapped
    assert canonical(huge) != canonical(huge + 1)
    assert canonical(-huge) != canonical(huge)
    assert canonical(2**2048) != canonical(2**2048 + 1)
    assert pickle.loads(pickle.dumps(huge)) == huge
    assert canonical(pickle.loads(pickle.dumps(huge))) == canonical(huge)


def test_decimal_key_ignores_the_decimal_context() -> None:
    """A Decimal keys the same whether the process's context writes exponents as ``E`` or ``e``."""
    value = Decimal("1E+5")
    before = canonical(value)
    with decimal.localcontext() as ctx:
        ctx.capitals = 0
        assert str(value) == "1e+5"
        inside = canonical(value)
    assert inside == before


# Types stay distinct.
@pytest.mark.parametrize(
    "values",
    [
        pytest.param([1, "1", 1.0, True, Decimal("1")], id="one"),
        pytest.param([0, "0", 0.0, -0.0, False, None, "", b"", [], {}, frozenset()], id="zero"),
        pytest.param([None, "None", "null", b"n"], id="none"),
        pytest.param([b"a", "a", bytearray(b"b"), ["a"]], id="bytes-str"),
        pytest.param([[1], {1}, {"1": 1}, 1], id="containers"),
        pytest.param([{"a": 1}, [["a", 1]], {"a": [1]}, [{"a": 1}]], id="dict-pairs"),
        pytest.param([Decimal("1.0"), Decimal("1"), Decimal("1.00"), 1.0], id="decimal"),
        pytest.param(
            [
                date(2020, 1, 1),
                datetime(2020, 1, 1),
                datetime(2020, 1, 1, tzinfo=timezone.utc),
                datetime(2020, 1, 1, 1, tzinfo=timezone(timedelta(hours=1))),
                "2020-01-01",
                "2020-01-01T00:00:00",
            ],
            id="dates",
        ),
        pytest.param([time(1), time(1, tzinfo=timezone.utc), "01:00:00"], id="times"),
        pytest.param([uuid.UUID(int=1), uuid.UUID(int=1).hex, str(uuid.UUID(int=1)), 1], id="uuid"),
    ],
)
def test_types_stay_distinct(values: list[Any]) -> None:
    """Values Python may call equal, or that print alike, get distinct keys when their types differ."""
    assert len({canonical(v) for v in values}) == len(values)


def test_tuple_and_list_share_a_key() -> None:
    """Deliberately, a tuple keys like a list: JSON turns a sent tuple into a list."""
    assert canonical((1,)) == canonical([1])
    assert canonical(((1, "a"), [2])) == canonical([[1, "a"], (2,)])
    assert canonical({1}) != canonical([1])
    assert canonical({1}) == canonical(frozenset({1}))


@KEYS_SETTINGS
@given(value=PICKLE_VALUES)
def test_swapping_tuples_and_lists_keeps_the_key(value: Any) -> None:
    """Turning every list into a tuple and vice versa, at any depth, keeps the key."""
    assert canonical(swap_sequences(value)) == canonical(value)


# No collisions.
@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("ab", "c"), ("a", "bc")),
        ([[1], [2]], [[1, 2]]),
        ([[1, 2], []], [[1], [2]]),
        (["a", ""], ["a"]),
        ([""], []),
        ({"a": "bc"}, {"ab": "c"}),
        ({"a": 1, "b": 2}, {"a": 1, "b2": None}),
        (frozenset({"ab", "c"}), frozenset({"a", "bc"})),
        ((b"ab", b"c"), (b"a", b"bc")),
        ([12, 3], [1, 23]),
        ("s1:a", ["a"]),
    ],
)
def test_no_collision_by_concatenation(left: Any, right: Any) -> None:
    """Splitting the same characters differently across values or nesting levels changes the key."""
    assert canonical(left) != canonical(right)
    assert digest(left) != digest(right)


@KEYS_SETTINGS
@given(x=SMALL_VALUES, y=SMALL_VALUES)
def test_same_canonical_form_iff_same_value(x: Any, y: Any) -> None:
    """Over a small domain where draws often coincide: equal canonical bytes exactly when the values are the same."""
    assert (canonical(x) == canonical(y)) == (normalize(x) == normalize(y))


@KEYS_SETTINGS
@given(x=PICKLE_VALUES, y=PICKLE_VALUES)
def test_canonical_form_tells_values_apart(x: Any, y: Any) -> None:
    """Over every supported type: equal canonical bytes exactly for the same value (tuples as lists)."""
    if canonical(x) == canonical(y):
        assert normalize(x) == normalize(y)
    else:
        assert normalize(x) != normalize(y)


# Order does not matter.
def test_dict_and_set_order_do_not_matter() -> None:
    """Dict insertion order and set iteration order do not change the key."""
    assert canonical({"a": 1, "b": 2}) == canonical({"b": 2, "a": 1})
    assert canonical({"x": {"a": 1, "b": [2]}}) == canonical({"x": {"b": [2], "a": 1}})
    words = [f"w{i}" for i in range(50)]
    assert canonical(set(words)) == canonical(rebuilt_in_reverse(set(words)))
    assert canonical(frozenset(range(100))) == canonical(frozenset(range(99, -1, -1)))


@KEYS_SETTINGS
@given(value=PICKLE_VALUES)
def test_reordering_dicts_and_sets_keeps_the_key(value: Any) -> None:
    """Rebuilding every dict and set in reverse order, at any depth, keeps the key."""
    assert canonical(reorder(value)) == canonical(value)


# Unsupported arguments.
def _lambda_arg() -> Callable[[], None]:
    return lambda: None


@pytest.mark.parametrize(
    "value",
    [object(), _lambda_arg(), Opaque(), 1j, [1, Opaque()], {"a": {"b": object()}}, {Opaque()}],
    ids=["object", "lambda", "custom-class", "complex", "nested-list", "nested-dict", "set"],
)
def test_unserialisable_argument_raises_key_derivation_error(value: Any) -> None:
    """An argument with no canonical form raises KeyDerivationError (a TypeError) pointing at lock_on/lock_key."""
    builder = KeyBuilder("t.sample", inspect.signature(sample))
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((value,), {})
    assert isinstance(excinfo.value, TypeError)
    message = str(excinfo.value)
    assert "lock_on" in message
    assert "lock_key" in message


def test_unserialisable_argument_message_names_the_type() -> None:
    """The error says which type could not be keyed."""
    with pytest.raises(KeyDerivationError) as excinfo:
        canonical(Opaque())
    assert "Opaque" in str(excinfo.value)


def test_lock_on_excludes_an_unserialisable_argument(app: Celery) -> None:
    """Keying on the other parameters with ``lock_on`` makes a call with an opaque argument work."""

    @app.task(base=SingletonTask, shared=False, lock_on=("account",))
    def sync(connection: Any, account: Any, full: bool = False) -> None:
        """Sample body."""

    with pytest.raises(KeyDerivationError):
        KeyBuilder("t.sync", inspect.signature(sync.run))((Opaque(), 7), {})
    key = sync.lock_name((Opaque(), 7), {})
    assert key == sync.lock_name((object(),), {"account": 7, "full": True})
    assert key != sync.lock_name((Opaque(), 8), {})


def test_lock_key_callable_computes_the_material(app: Celery) -> None:
    """A ``lock_key`` callable gets the call's arguments and its return value is keyed."""

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        lock_key=lambda connection, account, full=False: ("account", account),
    )
    def sync(self: Any, connection: Any, account: Any, full: bool = False) -> None:
        """Sample body."""

    key = sync.lock_name((Opaque(), 7), {})
    assert key == sync.lock_name((object(),), {"account": 7, "full": True})
    assert key != sync.lock_name((Opaque(), 8), {})
    assert key == KeyBuilder(sync.name, None, lock_key=lambda *a, **k: ["account", 7])((), {})


class Region(str, enum.Enum):
    """A ``str`` Enum: JSON delivers its value, while ``format()`` of the member
    gives ``Region.EU`` on Python 3.11 and later."""

    EU = "eu"


def test_lock_key_gets_every_spelling_of_a_call_by_name_with_defaults(app: Celery) -> None:
    """A ``lock_key`` callable is given the arguments by name, defaults applied: a
    callable that takes the one it needs and ``**_`` serves every spelling of a
    call, positional ones included."""

    @app.task(base=SingletonTask, shared=False, lock_key=lambda account_id, **_: account_id)
    def sync_account(account_id: int, since: str | None = None) -> None:
        """Sample body."""

    key = sync_account.lock_name((3, "2024-01-01"), {})
    assert key == sync_account.lock_name((3,), {"since": "2024-01-01"})
    assert key == sync_account.lock_name((), {"account_id": 3})
    assert key != sync_account.lock_name((4,), {})


def test_lock_key_that_cannot_take_what_args_or_kwargs_receive_is_refused(app: Celery) -> None:
    """What a task's ``*args`` or ``**kwargs`` receives comes to a ``lock_key``
    callable on top of the named arguments, by position or by name: one without
    ``*_`` (for ``*args``) or ``**_`` (for ``**kwargs``) is refused when the task
    is defined, naming ``lock_key`` and what to add; with them, calls with extra
    arguments have a key."""
    app.finalize()
    with pytest.raises(ValueError, match=r"lock_key .*\*\*options.*add \*\*_ "):

        @app.task(base=SingletonTask, shared=False, lock_key=lambda account: account)
        def sync_options(account: int, **options: Any) -> None:
            """Sample body."""

    with pytest.raises(ValueError, match=r"lock_key .* \*accounts.*add \*_ "):

        @app.task(base=SingletonTask, shared=False, lock_key=lambda first, **_: first)
        def sync_batch(first: int, *accounts: int, dry_run: bool = False) -> None:
            """Sample body."""

    @app.task(base=SingletonTask, shared=False, lock_key=lambda account, **_: account)
    def sync_taking_options(account: int, **options: Any) -> None:
        """Sample body."""

    key = sync_taking_options.lock_name((1,), {})
    assert key == sync_taking_options.lock_name((1,), {"dry_run": True, "since": None})

    @app.task(base=SingletonTask, shared=False, lock_key=lambda first, *_, **__: first)
    def sync_taking_batch(first: int, *accounts: int, dry_run: bool = False) -> None:
        """Sample body."""

    key = sync_taking_batch.lock_name((1,), {})
    assert sync_taking_batch.lock_name((1, 2, 3), {"dry_run": True}) == key


def test_lock_key_sees_the_arguments_as_a_worker_receives_them(app: Celery) -> None:
    """The key a send reserves is the one its execution takes: a ``lock_key``
    callable is given the arguments as they come out of the task's serializer on
    the producer too (a ``str`` Enum member as its value, a tuple as a list, under
    JSON), not as the caller's own objects."""

    @app.task(
        base=SingletonTask, shared=False, lock_key=lambda region, shape=(): f"{region}:{shape}"
    )
    def sync_region(region: Any, shape: Any = ()) -> None:
        """Sample body."""

    sent = sync_region.lock_name((Region.EU, (1, 2)), {})
    assert sent == sync_region.lock_name(["eu", [1, 2]], {})  # what the worker receives

    @app.task(
        base=SingletonTask,
        shared=False,
        serializer="pickle",
        lock_key=lambda region: type(region).__name__,
    )
    def sync_pickled(region: Any) -> None:
        """Sample body."""

    # Pickle delivers the member itself: so does the producer's side.
    assert sync_pickled.lock_name((Region.EU,), {}) != sync_pickled.lock_name(("eu",), {})


class SyncMode(str, enum.Enum):
    """A ``str`` Enum used as a default: JSON delivers a member passed as its value."""

    FULL = "full"
    QUICK = "quick"


class Unsent:
    """A sentinel no serializer carries (pickle included)."""

    def __reduce__(self) -> Any:
        raise TypeError("a sentinel is not sent")


#: A default no serializer can carry: the same object on the producer and the worker.
UNSET = Unsent()


def received(args: tuple[Any, ...], kwargs: dict[str, Any], serializer: str) -> tuple[Any, Any]:
    """A call's arguments as a worker receives them, through ``serializer``."""
    body = [list(args), kwargs]
    content_type, encoding, data = serialization.dumps(body, serializer=serializer)  # type: ignore[no-untyped-call,unused-ignore]
    sent = serialization.loads(data, content_type, encoding, force=True)  # type: ignore[no-untyped-call,unused-ignore]
    return sent[0], sent[1]


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_default_and_the_same_value_passed_are_one_call(app: Celery, serializer: str) -> None:
    """Every spelling of a call gets one lock name, a default and the same value
    passed included, on the producer and on the worker alike: a ``lock_key``
    callable is given the defaults as a worker receives them too (under JSON a
    ``str`` Enum member as its value, a tuple as a list), and a default the
    serializer cannot carry as it is; so is the key made of the arguments."""

    @app.task(
        base=SingletonTask,
        shared=False,
        serializer=serializer,
        lock_key=lambda account, mode, shape, since: f"{account}:{mode}:{shape}",
    )
    def sync(
        account: int, mode: SyncMode = SyncMode.FULL, shape: Any = (1, 2), since: Any = UNSET
    ) -> None:
        """Sample body: one default cannot be sent."""

    @app.task(
        base=SingletonTask,
        shared=False,
        serializer=serializer,
        lock_key=lambda account, mode, shape: f"{account}:{mode}:{shape}",
    )
    def sync_sendable(account: int, mode: SyncMode = SyncMode.FULL, shape: Any = (1, 2)) -> None:
        """Sample body: every default can be sent."""

    @app.task(base=SingletonTask, shared=False, serializer=serializer)
    def sync_by_arguments(
        account: int, mode: SyncMode = SyncMode.FULL, shape: Any = (1, 2)
    ) -> None:
        """Sample body."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, SyncMode.FULL), {}),
        ((1, SyncMode.FULL, (1, 2)), {}),
        ((), {"account": 1, "mode": SyncMode.FULL}),
    ]
    if serializer == "json":  # which delivers a tuple as a list (pickle keeps each as it is)
        calls.append(((1,), {"shape": [1, 2]}))
    for task in (sync, sync_sendable, sync_by_arguments):
        names = {task.lock_name(args, kwargs) for args, kwargs in calls}
        names |= {task.lock_name(*received(args, kwargs, serializer)) for args, kwargs in calls}
        assert len(names) == 1, task.name
        assert names != {task.lock_name((1, SyncMode.QUICK), {})}


def test_one_call_sent_pickled_and_as_json_to_a_pickle_task_is_two_values(app: Celery) -> None:
    """A pickle task receives a ``str`` Enum member from a pickled message and its
    value from a JSON one: a ``lock_key`` that formats it makes two names of one
    call (on Python 3.11 and later, where the member formats as ``Region.EU``), one
    that takes its value makes one; a JSON task sees both as the value."""

    def task(serializer: str, lock_key: Any) -> Any:
        @app.task(
            base=SingletonTask,
            shared=False,
            name=f"t.sync_{serializer}_{len(app.tasks)}",
            serializer=serializer,
            lock_key=lock_key,
        )
        def sync(region: Any) -> None:
            """Sample body."""

        return sync

    formatted = task("pickle", lambda region: f"region-{region}")
    by_value = task("pickle", lambda region: f"region-{Region(region).value}")
    as_json = task("json", lambda region: f"region-{region}")
    pickled, sent_as_json = received((Region.EU,), {}, "pickle"), received((Region.EU,), {}, "json")
    two = formatted.lock_name(*pickled) != formatted.lock_name(*sent_as_json)
    assert two is (sys.version_info >= (3, 11))
    assert by_value.lock_name(*pickled) == by_value.lock_name(*sent_as_json)
    assert as_json.lock_name(*pickled) == as_json.lock_name(*sent_as_json)


def test_a_dict_shaped_like_a_typed_json_value_arrives_as_another_value(app: Celery) -> None:
    """Under JSON, kombu decodes a dict with the keys ``__type__`` and ``__value__``
    as the type it names: the worker derives the name of that value, not the
    dict's (the limit the key documentation warns about)."""

    @app.task(base=SingletonTask, shared=False)
    def store(doc: Any) -> None:
        """Sample body."""

    doc = {"__type__": "decimal", "__value__": "1"}
    args, kwargs = received((doc,), {}, "json")
    assert args == [Decimal("1")]
    assert store.lock_name(args, kwargs) != store.lock_name((doc,), {})


def test_lock_key_that_raises_names_lock_key(app: Celery) -> None:
    """A ``lock_key`` callable that raises gives a KeyDerivationError naming it."""

    @app.task(base=SingletonTask, shared=False, lock_key=lambda account_id: 1 // account_id)
    def divide(account_id: int) -> None:
        """Sample body."""

    with pytest.raises(KeyDerivationError, match=r"lock_key of task .* raised ZeroDivisionError"):
        divide.lock_name((0,), {})


def test_lock_key_constant_string(app: Celery) -> None:
    """A constant ``lock_key`` gives every call the same key, whatever its arguments."""

    @app.task(base=SingletonTask, shared=False, lock_key="nightly")
    def rebuild(connection: Any, day: Any = None) -> None:
        """Sample body."""

    keys = {rebuild.lock_name((Opaque(),), {}), rebuild.lock_name((1,), {"day": date.today()})}
    assert len(keys) == 1
    assert KEY_RE.fullmatch(keys.pop())


def test_lock_key_returning_an_unserialisable_value_raises() -> None:
    """A ``lock_key`` callable returning something with no canonical form raises KeyDerivationError."""
    builder = KeyBuilder("t.sample", inspect.signature(sample), lock_key=lambda a, b=2: Opaque())
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((1,), {})
    assert "Opaque" in str(excinfo.value)


# lock_on naming parameters that do not exist.
def test_lock_on_unknown_parameter_fails_at_construction() -> None:
    """``KeyBuilder`` rejects ``lock_on`` names the signature lacks, naming each one."""
    with pytest.raises(ValueError, match="nope") as excinfo:
        KeyBuilder("t.sample", inspect.signature(sample), lock_on=("a", "nope"))
    assert "'nope'" in str(excinfo.value)
    assert "'a'" not in str(excinfo.value).split("(parameters")[0]
    with pytest.raises(ValueError, match="nope") as excinfo:
        KeyBuilder("t.sample", inspect.signature(sample), lock_on=("nope", "nah"))
    assert "'nah'" in str(excinfo.value)


def test_lock_on_unknown_parameter_fails_at_task_definition(app: Celery) -> None:
    """On a finalized app, defining a task whose ``lock_on`` names a missing parameter raises."""
    app.finalize()
    with pytest.raises(ValueError, match="nope") as excinfo:

        @app.task(base=SingletonTask, shared=False, lock_on=("nope",))
        def report(account: Any) -> None:
            """Sample body."""

    assert "'nope'" in str(excinfo.value)
    assert "report" in str(excinfo.value)


def test_lock_on_unknown_parameter_fails_when_a_lazy_task_is_created(app: Celery) -> None:
    """With ``lazy=False``, or on first use of a lazy task, a bad ``lock_on`` raises; ``self`` is not a parameter."""
    with pytest.raises(ValueError, match="self") as excinfo:

        @app.task(base=SingletonTask, shared=False, bind=True, lazy=False, lock_on=("self",))
        def bound(self: Any, account: Any) -> None:
            """Sample body."""

    assert "'self'" in str(excinfo.value)

    @app.task(base=SingletonTask, shared=False, lock_on=("nope",))
    def lazy(account: Any) -> None:
        """Sample body."""

    with pytest.raises(ValueError, match="nope") as excinfo:
        lazy.lock_name((1,), {})
    assert "'nope'" in str(excinfo.value)


# What a key reveals.
def test_key_shows_the_task_name_but_not_the_arguments(app: Celery) -> None:
    """A key is ``<task name>:<32 hex>``: the name is readable, argument values are not there in clear."""

    @app.task(base=SingletonTask, shared=False, name="billing.charge")
    def charge(card: Any, password: Any) -> None:
        """Sample body."""

    secret = "hunter2-secret"
    key = charge.lock_name(("4111111111111111",), {"password": secret})
    match = KEY_RE.fullmatch(key)
    assert match is not None
    assert match["task"] == "billing.charge"
    assert secret not in key
    assert "4111" not in key
    builder_key = KeyBuilder("t.login", inspect.signature(sample))((secret,), {})
    assert builder_key.startswith("t.login:")
    assert secret not in builder_key


# Calls that do not match the signature.
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2, 3), {}), ((), {}), ((1,), {"c": 3}), ((1,), {"a": 1})],
    ids=["too-many", "missing", "unexpected-keyword", "twice"],
)
def test_call_not_matching_the_signature_raises(
    app: Celery, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Arguments the body could not accept raise KeyDerivationError naming the task."""
    builder = KeyBuilder("t.sample", inspect.signature(sample))
    with pytest.raises(KeyDerivationError) as excinfo:
        builder(args, kwargs)
    assert "task 't.sample', whose body takes (a, b=2): " in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, TypeError)

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.bound_sample")
    def bound_sample(self: Any, a: Any, b: Any = 2) -> None:
        """Sample body."""

    with pytest.raises(KeyDerivationError) as excinfo:
        bound_sample.lock_name(args, kwargs)
    assert "'t.bound_sample'" in str(excinfo.value)


# Values that contain themselves.
def _recursive_list() -> list[Any]:
    items: list[Any] = [1]
    items.append(items)
    return items


def _recursive_dict() -> dict[str, Any]:
    mapping: dict[str, Any] = {"a": 1}
    mapping["self"] = mapping
    return mapping


def _cycle_through_a_tuple() -> tuple[Any, ...]:
    inner: list[Any] = []
    outer = (inner,)
    inner.append(outer)
    return outer


def _dict_inside_its_own_list() -> list[Any]:
    items: list[Any] = []
    items.append({"items": items})
    return items


RECURSIVE = [_recursive_list, _recursive_dict, _cycle_through_a_tuple, _dict_inside_its_own_list]
RECURSIVE_IDS = ["list", "dict", "tuple-list-cycle", "dict-in-list"]


@pytest.mark.parametrize("make", RECURSIVE, ids=RECURSIVE_IDS)
def test_recursive_value_raises_key_derivation_error(make: Callable[[], Any]) -> None:
    """A value that contains itself raises KeyDerivationError saying so, not RecursionError."""
    with pytest.raises(KeyDerivationError) as excinfo:
        canonical(make())
    assert "contains itself" in str(excinfo.value)


@pytest.mark.parametrize("make", RECURSIVE, ids=RECURSIVE_IDS)
def test_recursive_argument_is_named(make: Callable[[], Any]) -> None:
    """A recursive task argument raises KeyDerivationError naming the argument and the task."""
    builder = KeyBuilder("t.sample", inspect.signature(sample))
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((1,), {"b": make()})
    message = str(excinfo.value)
    assert "argument 'b' of task 't.sample'" in message
    assert "contains itself" in message


def test_recursive_lock_key_result_is_named() -> None:
    """A lock_key callable returning a recursive value raises KeyDerivationError naming lock_key."""
    builder = KeyBuilder(
        "t.sample", inspect.signature(sample), lock_key=lambda a, b=2: [a, _recursive_list()]
    )
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((1,), {})
    assert "lock_key" in str(excinfo.value)
    assert "contains itself" in str(excinfo.value)


def test_unkeyable_raw_argument_is_named_by_position() -> None:
    """Without a signature, an argument with no key is named by its position or keyword."""
    builder = KeyBuilder("t.raw", None)
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((1, Opaque()), {})
    assert "positional argument 1 of task 't.raw'" in str(excinfo.value)
    with pytest.raises(KeyDerivationError) as excinfo:
        builder((1,), {"conn": Opaque()})
    assert "argument 'conn' of task 't.raw'" in str(excinfo.value)


def test_too_deeply_nested_value_raises_key_derivation_error() -> None:
    """A value nested deeper than the interpreter can recurse raises KeyDerivationError."""
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    with pytest.raises(KeyDerivationError) as excinfo:
        canonical(deep)
    assert "nested" in str(excinfo.value)


def test_shared_values_keep_their_canonical_form() -> None:
    """The same object appearing twice (not inside itself) is fine, and its form did not change."""
    shared = [1, "a"]
    value = {
        "shared": [shared, shared, (shared,)],
        "nested": {"s": frozenset({1, 2}), "t": (1.5, None, True)},
        "b": b"\x00",
    }
    assert canonical(value) == (
        b"d101:s1:by1:\x00s6:nestedd30:s1:se8:i1:1i1:2s1:tl8:f3:1.5nTs6:shared"
        b"l37:l8:i1:1s1:al8:i1:1s1:al11:l8:i1:1s1:a"
    )
    assert digest(value) == "63bbff39b69db91787c52d508fe3018a"


def test_plain_signatures_bind_like_inspect() -> None:
    """Calls to a task of plain parameters are bound without ``inspect`` and their
    material encoded in an order sorted once, on the hot path; every call gets
    the same key (or the same error) as ``Signature.bind`` + ``apply_defaults``
    and the general encoder give, whatever the values and with ``lock_on`` too."""

    def body(a: Any, b: Any = 2, c: Any = "x") -> None: ...

    recursive: list[Any] = []
    recursive.append(recursive)
    for lock_on in (None, ("c", "a"), ("b", "b")):
        fast = KeyBuilder("t", inspect.signature(body), lock_on=lock_on)
        general = KeyBuilder("t", inspect.signature(body), lock_on=lock_on)
        general._plain = general._order = None
        assert fast._order is not None
        values: list[Any] = [1.5, -0.0, [1, {"k": None}], {3, 1}, "é", b"\x00", object(), recursive]
        for value in values:
            outcomes = []
            for builder in (fast, general):
                try:
                    outcomes.append(builder((value,), {"c": value}))
                except KeyDerivationError as exc:
                    outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1], (lock_on, value)

    fast = KeyBuilder("t", inspect.signature(body))
    general = KeyBuilder("t", inspect.signature(body))
    general._plain = general._order = None
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, 3), {}),
        ((1, 3, "y"), {}),
        ((), {"a": 1}),
        ((1,), {"c": "z"}),
        ((), {"c": "z", "a": 1, "b": 5}),
        ((1, 2, "x", 4), {}),  # too many
        ((1,), {"a": 1}),  # twice
        ((), {"b": 1}),  # a missing
        ((1,), {"d": 1}),  # unknown
    ]
    for args, kwargs in calls:
        outcomes = []
        for builder in (fast, general):
            try:
                outcomes.append(builder(args, kwargs))
            except KeyDerivationError as exc:
                outcomes.append(type(exc).__name__)
        assert outcomes[0] == outcomes[1], (args, kwargs)
    assert fast._plain is not None


def test_positional_calls_of_text_and_numbers_key_like_the_general_path() -> None:
    """A call passing every parameter positionally (a tuple, or a list as a worker
    decodes it from JSON), of exact ``str`` (ASCII), ``int`` and ``float`` values
    (the usual Celery message), is encoded as text in one go; it gets the same key
    as the general encoder for every value, and the values it does not take (other
    types, subclasses, non-ASCII text, huge ints) go the general way."""

    class Number(enum.IntEnum):
        ONE = 1

    class Real(float):
        pass

    def body(a: Any, b: Any, c: Any = 0) -> None: ...

    values: list[Any] = [
        "", "plain ascii", "é", "\ud83d", "x" * 2000,
        0, -7, 2**64, 2**2048, -(2**2049), True, Number.ONE,
        0.0, -0.0, 1e300, float("nan"), float("inf"), Real(2.5),
        None, b"x", [1, "a"], {"k": 1.5},
    ]  # fmt: skip
    for lock_on in (None, ("c", "a")):
        fast = KeyBuilder("t", inspect.signature(body), lock_on=lock_on)
        general = KeyBuilder("t", inspect.signature(body), lock_on=lock_on)
        general._plain = general._order = None
        for index, value in enumerate(values):
            args = (value, values[-index - 1], value)
            assert fast(args, {}) == general(args, {}), (lock_on, args)
            assert fast(args, None) == general(list(args), {}), (lock_on, args)
            assert fast(list(args), None) == general(args, {}), (lock_on, args)
        usual = ("report-42", 7, 0.5)
        assert _text_digest(usual, fast._positions) is not None
        assert fast(usual, {}) == general(usual, {}) == fast(list(usual), {})

    # A parameter named in other than ASCII has a form of more bytes than
    # characters: such a task takes the general path.
    def accented(café: Any, b: Any) -> None: ...

    fast = KeyBuilder("t", inspect.signature(accented))
    general = KeyBuilder("t", inspect.signature(accented))
    general._plain = general._order = None
    assert fast._arity == -1
    assert fast(("x", 1), {}) == general(("x", 1), {})


# (No deadline: a test process stalled by the others beside it is no failure.)
@settings(deadline=None)
@given(st.binary(max_size=300))
def test_lock_names_hash_with_sha256_whatever_implements_it(data: bytes) -> None:
    """Lock names are hashed by CPython's own SHA-256 where it has one, which gives
    hashlib's (OpenSSL's) digest, so names do not depend on which one a process
    uses."""
    assert _sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()


def test_cpythons_own_sha256_is_preferred_and_hashlibs_is_the_fallback() -> None:
    """The first module with a ``sha256`` is used; none (a build that leaves hashing
    to OpenSSL) falls back to hashlib's."""
    if any(importlib.util.find_spec(name) for name in ("_sha2", "_sha256")):
        assert _sha256 is not hashlib.sha256
    assert _sha256_from(("no_such_module_here", "math")) is hashlib.sha256
    assert _sha256_from(("hashlib",)) is hashlib.sha256


def test_mapping_keys_are_taken_as_json_sends_them() -> None:
    """JSON object keys are text: a number, boolean or None key arrives as the text JSON
    writes for it, so the key derived where the task is sent (``{1: "a"}``) is the one
    derived where it runs (``{"1": "a"}``)."""
    for sent in ({1: "a"}, {1.5: "a"}, {True: "a"}, {None: "a"}, {float("inf"): "a"}):
        assert canonical(sent) == canonical(json_round_trip(sent))
    assert canonical({1: "a"}) == canonical({"1": "a"})
    assert canonical({1: "a"}) != canonical({1.0: "a"})
    assert canonical({"1": "a"}) != canonical({"1": 1})


def test_a_pickle_task_names_calls_by_the_json_rules_too(app: Celery) -> None:
    """Pickle delivers ``{1: "v"}`` and ``{"1": "v"}``, or a tuple and a list,
    apart, but their lock names follow the JSON rules whatever the serializer:
    such calls are one call (what the docs tell users to keep in mind)."""

    @app.task(base=SingletonTask, shared=False, name="keys.lookup", serializer="pickle")
    def lookup(table: Any, item: Any) -> None: ...

    assert lookup.lock_name(({1: "v"}, "1"), {}) == lookup.lock_name(({"1": "v"}, "1"), {})
    assert lookup.lock_name(({True: "v"}, "x"), {}) == lookup.lock_name(({"true": "v"}, "x"), {})
    assert lookup.lock_name(((1, 2), "x"), {}) == lookup.lock_name(([1, 2], "x"), {})


def test_mapping_keys_that_json_would_merge_are_refused() -> None:
    """Two keys of one mapping that a JSON message carries as the same text (``1``
    and ``"1"``) would arrive as one: the key sent and the key run could not agree,
    so such a mapping has no key, and the error says why."""
    with pytest.raises(KeyDerivationError, match="same text"):
        canonical({1: "x", "1": "x"})
    with pytest.raises(KeyDerivationError, match="same text"):
        canonical([{"a": {True: 1, "true": 2}}])

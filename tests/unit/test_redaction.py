"""``redact_url`` masks a password whatever it holds, in every form a driver takes it: a
property over arbitrary passwords. Strict and sound at once: the redacted text must not
depend on the password at all (the same as with another password), so nothing of it, not
even its length, gets through, and no test fails because a short password happens to spell
part of the host. Before the fix, ``postgresql://u:PW hotel@h/db`` was printed as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import example, given
from hypothesis import strategies as st

from batching.redaction import redact_mapping, redact_url

HOST = "db-host.example"
PLACEHOLDER = "placeholder"


def _libpq_quoted(password: str) -> str:
    return "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"


# Each form a password reaches the drivers in (or an error message quotes it in).
FORMS: dict[str, Callable[[str], str]] = {
    "url": lambda pw: f"postgresql://scorer:{pw}@{HOST}:5432/scores",
    "url+driver": lambda pw: f"postgresql+psycopg://scorer:{pw}@{HOST}/scores",
    "postgres://": lambda pw: f"postgres://:{pw}@{HOST}/scores",
    "url-encoded": lambda pw: f"postgresql://scorer:{quote(pw, safe='')}@{HOST}/scores",
    "url in a message": lambda pw: (
        f"connection to 'postgresql+psycopg://scorer:{pw}@{HOST}:5432/scores' failed (timeout)"
    ),
    "url in a stack trace": lambda pw: (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        f"OperationalError: postgresql://scorer:{pw}@{HOST}/scores: refused\n"
        "(Background on this error at: https://sqlalche.me/e/20/e3q8)"
    ),
    "query, encoded": lambda pw: (
        f"postgresql://scorer@{HOST}/scores?sslmode=require&password={quote(pw)}&x=1"
    ),
    "libpq, quoted": lambda pw: f"host={HOST} password={_libpq_quoted(pw)} dbname=scores",
    "sqlalchemy URL": lambda pw: sa.URL.create(
        "postgresql+psycopg", "scorer", pw, HOST, 5432, "scores"
    ).render_as_string(hide_password=False),
    "sqlalchemy URL object": lambda pw: redact_url(
        sa.URL.create("postgresql+psycopg", "scorer", pw, HOST, 5432, "scores")
    ),
}
# Raw in a query, a password cannot hold '&' (it splits the query) or a line break (SQLAlchemy
# reads the query to the line's end); unquoted in libpq, no space, quote or backslash.
RAW_QUERY: Callable[[str], str] = lambda pw: f"postgresql://scorer@{HOST}/scores?password={pw}"  # noqa: E731
LIBPQ_BARE: Callable[[str], str] = lambda pw: f"host={HOST} password={pw} dbname=scores"  # noqa: E731

LIBPQ_SPECIAL = " \t\n\r\f\v'\"\\"  # a space as libpq reads it (C isspace), quotes, escape
URL_SPECIAL = st.sampled_from([" ", "@", ":", "/", "#", "?", "%", "%40", "&", "'", '"', "\\", "\n"])
passwords = st.one_of(
    st.text(min_size=1),
    st.lists(URL_SPECIAL | st.text(min_size=1, max_size=4), min_size=1, max_size=8).map("".join),
)


def _check(form: Callable[[str], str], password: str) -> None:
    redacted = redact_url(form(password))
    assert redacted == redact_url(form(PLACEHOLDER))  # nothing of the password shows
    assert HOST in redacted
    assert "scores" in redacted
    if len(password) >= 3:
        assert password not in redacted or password in redact_url(form(PLACEHOLDER))


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@given(password=passwords)
@example(password="PW hotel")
@example(password="p@ss word/with:all?#%20")
def test_no_part_of_a_password_survives_redaction(
    form: Callable[[str], str], password: str
) -> None:
    _check(form, password)


@given(password=passwords.filter(lambda pw: "&" not in pw and "\n" not in pw))
@example(password="a b")
def test_a_raw_password_in_a_query_is_masked_to_the_next_pair(password: str) -> None:
    _check(RAW_QUERY, password)
    tail = redact_url(RAW_QUERY(password) + "&sslmode=require")
    assert tail.endswith("?password=***&sslmode=require")


@given(password=st.text(min_size=1).filter(lambda pw: not any(c in pw for c in LIBPQ_SPECIAL)))
def test_an_unquoted_libpq_password_is_masked(password: str) -> None:
    _check(LIBPQ_BARE, password)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:PW hotel@h/db", "postgresql://u:***@h/db"),
        ("postgresql+psycopg://u:p@ss@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
        ("error: postgresql://u:x y z@h/db failed", "error: postgresql://u:***@h/db failed"),
        ("postgresql://u@h/db?password=a b&ssl=1", "postgresql://u@h/db?password=***&ssl=1"),
        ("host=h password='a b' user=u", "host=h password='***' user=u"),
        ("host=h password=a\\ b user=u", "host=h password=*** user=u"),
        ('{"password": "a \\" b", "user": "u"}', '{"password": "***", "user": "u"}'),
        (
            "s3://b/k?X-Amz-Signature=s3cr3t&X-Amz-Date=1",
            "s3://b/k?X-Amz-Signature=***&X-Amz-Date=1",
        ),
        (
            "https://a.blob.core.windows.net/c?sv=2020&sig=s3cr3t",
            "https://a.blob.core.windows.net/c?sv=2020&sig=***",
        ),
        (
            "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=s3cr3t",
            "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=***",
        ),
        ('{"azure_storage_master_key": "s3cr3t"}', '{"azure_storage_master_key": "***"}'),
        ("http://marquez:5000/api https://sqlalche.me/e/20", None),  # nothing to mask
        ("the design: a signed commit", None),
        ("postgresql://u@h:5432/db", None),
    ],
)
def test_redact_url_keeps_what_is_not_a_secret(text: str, expected: str | None) -> None:
    assert redact_url(text) == (text if expected is None else expected)


@given(password=passwords)
def test_redact_mapping_masks_a_url_with_any_password(password: str) -> None:
    settings = {"database": {"url": FORMS["url"](password)}, "name": "score"}
    assert redact_mapping(settings) == redact_mapping(
        {"database": {"url": FORMS["url"](PLACEHOLDER)}, "name": "score"}
    )

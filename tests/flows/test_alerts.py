"""``python -m flows.alerts``: its argument is checked before anything is saved."""

from __future__ import annotations

import pytest

from flows import alerts


@pytest.mark.parametrize(
    "url", ["not-a-url", "hooks.example.com/x", "ftp://h/x", "https://", "http://h:port/x"]
)
def test_a_webhook_url_that_is_not_http_is_refused_with_exit_2(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``not-a-url`` was saved as the alert target: alerting silently broken."""
    with pytest.raises(SystemExit) as exited:
        alerts.main(["--webhook-url", url])
    assert exited.value.code == 2
    assert "is not an http(s) URL like https://hooks.example.com/alerts" in capsys.readouterr().err


def test_a_refused_webhook_url_keeps_its_secret_out_of_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        alerts.main(["--webhook-url", "ftp://u:s3cret@h/x"])
    assert "s3cret" not in capsys.readouterr().err


@pytest.mark.parametrize("url", ["https://hooks.example.com/alerts", "http://127.0.0.1:9/x"])
def test_http_webhook_urls_are_accepted(url: str) -> None:
    assert alerts.webhook_url(url) == url

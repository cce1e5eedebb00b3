"""The ``ringlet-ignored`` header names the hints a request carried, whatever characters a
client put in its own keys (``stream_options.<key>``): a header value is latin-1, and the
API's fuzzer once sent a key that made every such reply a 500."""

from __future__ import annotations

from ringlet.daemon.api.fields import HEADER, Ignored


def test_hint_names_past_ascii_are_escaped_into_a_valid_header():
    names = ["stream_options.\U00063401\u00d6", "stream_options.\ud94d", "user"]
    value = Ignored("completions", names).headers()[HEADER]
    value.encode("latin-1")  # what the server does with it
    assert value == "stream_options.\\U00063401\\xd6, stream_options.\\ud94d, user"
    assert Ignored("completions").headers() == {}

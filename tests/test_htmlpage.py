"""The helpers every HTML page uses (tensorverse/htmlpage.py): data that cannot close its
element, text that cannot become markup, the CSP hash a browser computes."""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np

from tensorverse.htmlpage import csp_hash, embed_json, esc


def test_embed_json_round_trips_specials():
    value = {"a": "</script><!-- <script>", "b": "\u2028\u2029&", "c": [1.5, None], 3: "key"}
    text = embed_json(value)
    assert "<" not in text and ">" not in text and "&" not in text
    assert "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == {"a": value["a"], "b": value["b"], "c": [1.5, None], "3": "key"}
    assert json.loads(embed_json({"x": np.float32(0.5), "v": np.arange(3)})) == {"x": 0.5, "v": [0, 1, 2]}


def test_esc_quotes_attributes_and_shows_none_as_a_dash():
    assert esc('"><img src=x onerror=alert(1)>') == "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"
    assert esc("it's") == "it&#x27;s" and esc(None) == "-" and esc(0) == "0"


def test_csp_hash_is_the_sha256_a_browser_computes():
    js = "console.log('x')"
    assert csp_hash(js) == "'sha256-" + base64.b64encode(hashlib.sha256(js.encode()).digest()).decode() + "'"

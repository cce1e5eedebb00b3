"""Shared by the speculative decoding tests: prompts where drafts hit, the whole model's
greedy ids in this process (one token per forward, no drafts), and the near-tie rule.

The expected ids come from the whole model run token by token here (MLX, float32, one
process, no ring, no drafts), as ``test_concurrency.py`` checks batching; a verifying
forward of k + 1 positions may round differently from k + 1 one-token forwards, so the
rule is the same: equal, or the first difference is at a near-tie of the reference's
logits (top two within 1e-3 of their magnitude) and both tokens are those two.
"""

from __future__ import annotations

import httpx

NEAR_TIE = 1e-3

CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
        "def describe(width, height):\n    return f\"{width} by {height}\"\n")
#: (user message, max_tokens, prediction or None): drafts hit (code repeated back, with
#: and without the expected output as the prediction) and miss (free text)
CASES = [
    ("Repeat this Python code exactly, nothing else:\n\n" + CODE, 36, None),
    ("Rename width to w in this code and return the whole file:\n\n" + CODE, 36,
     CODE.replace("width", "w")),
    ("Write a short story about a lighthouse keeper.", 12, None),
]


def chat(url: str, message: str, max_tokens: int, prediction: str | None = None, **extra) -> dict:
    """One chat completion; its prompt ids, completion ids and usage."""
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return {"prompt": choice["prompt_token_ids"], "ids": choice["token_ids"], "usage": out["usage"]}


class WholeModel:
    """The whole default model in this process (float32), greedy, one token per forward."""

    def __init__(self) -> None:
        from ringlet.daemon.engine.sources import resolve
        from ringlet.daemon.engine.stage import load_stage

        self.stage = load_stage(resolve(None), 0, None, "float32")
        self._memo: dict[tuple, tuple[list[int], list[list[float]]]] = {}

    def greedy(self, prompt: list[int], n: int, stop: set[int]) -> tuple[list[int], list[list[float]]]:
        """``n`` greedy ids after ``prompt`` (ending at a stop id), and the logits each
        was chosen from."""
        import mlx.core as mx

        key = (tuple(prompt), n)
        if key not in self._memo:
            cache = self.stage.make_cache()
            logits = self.stage(mx.array([prompt], dtype=mx.int32), cache)[0, -1]
            ids, rows = [], []
            while len(ids) < n:
                row = logits.tolist()
                token = max(range(len(row)), key=row.__getitem__)
                ids.append(token)
                rows.append(row)
                if token in stop:
                    break
                logits = self.stage(mx.array([[token]], dtype=mx.int32), cache)[0, -1]
            self._memo[key] = (ids, rows)
        return self._memo[key]


def assert_same_or_near_tie(got: list[int], want: list[int], rows: list[list[float]], what: str) -> None:
    """``got`` equals ``want``, or first differs at a near-tie of ``rows`` (the
    reference's logits) between the two tokens there (the rule above)."""
    if got == want:
        return
    k = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert k is not None, f"{what}: {len(got)} ids, expected {len(want)}"
    row = rows[k]
    top2 = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:2]
    a, b = row[top2[0]], row[top2[1]]
    assert a - b < NEAR_TIE * max(abs(a), abs(b)), f"{what}: differs at token {k} without a near-tie"
    assert got[k] in top2 and want[k] in top2

"""``tensorverse doctor --backend URL``: what a backend supports, checked cheaply through its API.

Reported (``--json``: one object with these keys):

``reachable``      the OpenAI API answered (``/v1/models``)
``version``        vLLM's ``/version``
``models``         served model ids (with ``max_model_len``); ``model`` is the one checked
``max_logprobs``   read from vLLM's refusal of an impossible ``logprobs`` count (nothing generated)
``vocab_size``     the logits width, read from vLLM's refusal of an out-of-range ``logprob_token_ids``
``plugin``         the Tensorverse capture plugin is loaded and active: one step is *forced* to a
                   token the model would not pick greedily; if that token comes back, forcing works
``capture_sink``   the plugin accepts ``tv_capture`` (a sink is configured on the server); the
                   probe captures no row (its only capture position is never reached)
``capture``        ``full`` (plugin + sink: full-vocabulary rows), ``topk`` (API logprobs only)
``tokenizer``      the tokenizer fingerprint (:mod:`tensorverse.shadow.tokenizer`)
``problems``       what failed, in words

Exit status 0 when the backend is reachable, 2 otherwise.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from typing import Any

import orjson

from tensorverse.capture.optin import KEY_CAPTURE, KEY_FORCE, KEY_POSITIONS, MAX_POSITION
from tensorverse.shadow.backend import Backend
from tensorverse.shadow.client import BackendClient, BackendError
from tensorverse.shadow.tokenizer import fingerprint, same_dictionary

__all__ = ["probe_capabilities", "max_logprobs", "doctor", "format_report", "run_doctor"]

_MAX_ALLOWED_RE = re.compile(r"max allowed:\s*(-?\d+)")
_PROBE_TEXT = "The capital of France is"
_FALLBACK_PROMPT = [785, 6722, 315, 9625, 374]  # "The capital of France is" (Qwen2/3 ids)


def _with_model(body: dict[str, Any], backend: Backend) -> dict[str, Any]:
    if backend.model:
        body["model"] = backend.model
    return body


async def _probe_prompt(client: BackendClient) -> list[int]:
    try:
        out = await client.post("/tokenize", _with_model({"prompt": _PROBE_TEXT,
                                                          "add_special_tokens": False},
                                                         client.backend), root=True)
        toks = out.get("tokens") if isinstance(out, dict) else None
        if isinstance(toks, list) and toks:
            return [int(t) for t in toks]
    except BackendError:
        pass
    return list(_FALLBACK_PROMPT)


def _top_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids of the first position's top logprobs, most likely first."""
    lp = (choice.get("logprobs") or {}).get("top_logprobs") or []
    if not lp or not isinstance(lp[0], dict):
        return []
    items = sorted(lp[0].items(), key=lambda kv: -float(kv[1]))
    out = []
    for k, _ in items:
        s = k[len("token_id:"):] if isinstance(k, str) and k.startswith("token_id:") else k
        try:
            out.append(int(s))
        except (TypeError, ValueError):
            continue
    return out


async def probe_capabilities(client: BackendClient) -> dict[str, Any]:
    """Plugin present? Forcing works? Capture sink configured? Two one-token requests.

    Returns ``{"plugin", "forcing", "capture_sink", "capture", "detail"}``; ``plugin`` is None
    when the probe itself failed (``error`` says why)."""
    b = client.backend
    prompt = await _probe_prompt(client)
    base = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    out: dict[str, Any] = {"plugin": None, "forcing": None, "capture_sink": None,
                           "capture": "topk", "detail": ""}
    try:
        greedy = await client.completions(_with_model(dict(base), b))
    except BackendError as e:
        out["error"] = f"probe request failed: {e}"
        return out
    choice = greedy["choices"][0]
    g = (choice.get("token_ids") or [None])[0]
    alts = [t for t in _top_ids(choice) if t != g]
    if g is None or not alts:
        out["error"] = "the backend returned no token ids or logprobs (return_token_ids/logprobs)"
        return out
    forced = alts[0]
    probe_id = f"tensorverse-doctor-{os.urandom(4).hex()}"
    xargs = {KEY_FORCE: [forced], KEY_CAPTURE: probe_id, KEY_POSITIONS: str(MAX_POSITION)}
    body = _with_model({**base, "ignore_eos": True, "vllm_xargs": xargs}, b)
    try:
        resp = await client.completions(body)
        out["capture_sink"] = True
    except BackendError as e:
        if e.kind == "http" and e.status == 400 and ("tv_capture" in e.message or "sink" in e.message):
            out["capture_sink"] = False
            body["vllm_xargs"] = {KEY_FORCE: [forced]}
            try:
                resp = await client.completions(body)
            except BackendError as e2:
                out["error"] = f"forcing probe failed: {e2}"
                return out
        else:
            out["error"] = f"forcing probe failed: {e}"
            return out
    emitted = (resp["choices"][0].get("token_ids") or [None])[0]
    out["forcing"] = emitted == forced
    if out["forcing"]:
        out["plugin"] = True
        if out["capture_sink"]:
            out["capture"] = "full"
            out["detail"] = "plugin active, forcing works, capture sink configured"
        else:
            out["detail"] = ("plugin active and forcing works, but no capture sink is configured "
                             "(set TENSORVERSE_CAPTURE_SINK on the server): top-k logprobs only")
    elif out["capture_sink"] is False:  # the plugin validated tv_capture, yet did not force
        out["plugin"] = True
        out["detail"] = (f"the plugin is loaded (it checked the opt-in) but forced token {forced} "
                         f"was not emitted (got {emitted}): forcing does not work on this server")
    else:  # vllm_xargs were accepted and ignored: no plugin (or TENSORVERSE_CAPTURE=0)
        out["plugin"] = False
        out["capture_sink"] = None
        out["detail"] = (f"forced token {forced} was not emitted (got {emitted}, greedy {g}): the "
                         "Tensorverse plugin is not installed in this server's environment, or "
                         "it is switched off (TENSORVERSE_CAPTURE=0)")
    return out


async def max_logprobs(client: BackendClient) -> int | None:
    """The server's ``--max-logprobs`` from its refusal of an impossible count (nothing runs)."""
    body = _with_model({"prompt": [0], "max_tokens": 1, "logprobs": 2**31 - 1}, client.backend)
    try:
        await client.completions(body, timeout_s=min(client.backend.timeout_s, 30))
    except BackendError as e:
        m = _MAX_ALLOWED_RE.search(e.message or "")
        return int(m.group(1)) if m else None
    return None


async def doctor(url: str, model: str | None = None, *, api_key: str | None = None,
                 timeout_s: float = 30.0, primary: str | None = None) -> dict[str, Any]:
    """Check one backend; never raises for backend trouble (it lands in ``problems``)."""
    report: dict[str, Any] = {
        "backend": url, "reachable": False, "version": None, "models": [], "model": model,
        "max_model_len": None, "max_logprobs": None, "vocab_size": None, "plugin": None,
        "forcing": None, "capture_sink": None, "capture": None, "tokenizer": None,
        "problems": [],
    }
    backend = Backend(name="doctor", url=url, model=model, api_key=api_key, timeout_s=timeout_s)
    async with BackendClient(backend) as client:
        try:
            models = await client.get("/models")
        except BackendError as e:
            report["problems"].append(f"not reachable: {e}")
            report["reachable"] = e.kind == "http"  # it answered, not as hoped (auth, path)
            return report
        report["reachable"] = True
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list):
            report["models"] = [{"id": m.get("id"), "max_model_len": m.get("max_model_len")}
                                for m in data if isinstance(m, dict)]
        ids = [m["id"] for m in report["models"]]
        if model is None and ids:
            model = ids[0]
        elif model is not None and ids and model not in ids:
            report["problems"].append(f"model {model!r} is not served here (served: {ids})")
        report["model"] = model
        backend.model = model
        for m in report["models"]:
            if m["id"] == model:
                report["max_model_len"] = m["max_model_len"]
        try:
            v = await client.get("/version", root=True)
            report["version"] = v.get("version") if isinstance(v, dict) else None
        except BackendError as e:
            report["problems"].append(f"no /version (not vLLM?): {e}")
        report["max_logprobs"] = await max_logprobs(client)
        caps = await probe_capabilities(client)
        report.update({k: caps.get(k) for k in ("plugin", "forcing", "capture_sink", "capture")})
        report["plugin_detail"] = caps.get("detail") or caps.get("error")
        if caps.get("error"):
            report["problems"].append(caps["error"])
        fp = await fingerprint(client)
        report["vocab_size"] = fp.get("vocab_size")
        report["tokenizer"] = {k: fp.get(k) for k in ("available", "fingerprint", "special",
                                                     "template_fingerprint", "error")
                               if fp.get(k) is not None}
        if not fp.get("available"):
            report["problems"].append(f"tokenizer not fingerprinted: {fp.get('error')}")
        if primary:
            pb = Backend(name="primary", url=primary, api_key=api_key, timeout_s=timeout_s)
            async with BackendClient(pb) as pc:
                try:
                    pm = await pc.get("/models")
                    pdata = pm.get("data") if isinstance(pm, dict) else None
                    if pdata:
                        pb.model = pdata[0].get("id")
                except BackendError:
                    pass
                pfp = await fingerprint(pc)
            ok, msg = same_dictionary(pfp, fp, primary_name="primary", shadow_name="this backend")
            report["same_dictionary"] = ok
            report["same_dictionary_detail"] = msg
            if pfp.get("template_fingerprint") and fp.get("template_fingerprint"):
                report["same_template"] = pfp["template_fingerprint"] == fp["template_fingerprint"]
    return report


def format_report(r: dict[str, Any]) -> str:
    def yn(v: Any) -> str:
        return "unknown" if v is None else ("yes" if v else "no")

    lines = [f"backend        {r['backend']}", f"reachable      {yn(r['reachable'])}"]
    if not r["reachable"] or not r.get("models") and r.get("problems"):
        for p in r.get("problems", []):
            lines.append(f"problem        {p}")
        return "\n".join(lines)
    lines.append(f"vLLM version   {r.get('version') or 'unknown'}")
    served = ", ".join(f"{m['id']} (max_model_len {m['max_model_len']})" for m in r["models"]) or "none"
    lines.append(f"models         {served}")
    lines.append(f"checked model  {r.get('model')}")
    ml, vs = r.get("max_logprobs"), r.get("vocab_size")
    mls = "unknown" if ml is None else (f"{ml} (whole vocabulary)" if vs and ml >= vs else str(ml))
    lines.append(f"max logprobs   {mls}")
    lines.append(f"vocabulary     {vs if vs is not None else 'unknown'}")
    plug = yn(r.get("plugin"))
    if r.get("plugin"):
        plug = "present, forcing works" if r.get("forcing") else "present, forcing NOT working"
    lines.append(f"plugin         {plug}")
    cap = r.get("capture")
    capd = {"full": "full (capture sink configured: full-vocabulary rows)",
            "topk": "top-k (API logprobs only; metrics approximate)"}.get(cap or "", "unknown")
    lines.append(f"capture        {capd}")
    if r.get("plugin_detail"):
        lines.append(f"               {r['plugin_detail']}")
    tok = r.get("tokenizer") or {}
    if tok.get("available"):
        sp = tok.get("special") or {}
        shown = ", ".join(f"{k}={sp[k]}" for k in ("<|im_end|>", "<tool_call>", "<think>")
                          if isinstance(sp.get(k), int))
        lines.append(f"tokenizer      {tok.get('fingerprint')}" + (f" ({shown})" if shown else ""))
        if tok.get("template_fingerprint"):
            lines.append(f"chat template  {tok['template_fingerprint']}")
    else:
        lines.append(f"tokenizer      unknown ({tok.get('error')})")
    if "same_dictionary" in r:
        lines.append(f"vs primary     {r.get('same_dictionary_detail')}")
        if "same_template" in r:
            lines.append(f"               chat template {'same' if r['same_template'] else 'DIFFERENT (template_mismatch)'}")
    for p in r.get("problems", []):
        lines.append(f"problem        {p}")
    return "\n".join(lines)


def run_doctor(backend: str, model: str | None = None, *, as_json: bool = False,
               timeout_s: float = 30.0, primary: str | None = None) -> int:
    """The CLI entry: print the report; 0 when reachable, 2 otherwise."""
    api_key = os.environ.get("TENSORVERSE_BACKEND_API_KEY") or None
    try:
        report = asyncio.run(doctor(backend, model, api_key=api_key, timeout_s=timeout_s,
                                    primary=primary))
    except ValueError as e:  # a malformed URL
        report = {"backend": backend, "reachable": False, "problems": [str(e)]}
    if as_json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
    else:
        print(format_report(report))
        if not report["reachable"]:
            print(f"tensorverse doctor: {backend} is not reachable", file=sys.stderr)
    return 0 if report["reachable"] else 2

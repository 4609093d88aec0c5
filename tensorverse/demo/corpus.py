"""The demo's little world: five router tools, a simulated router that answers them, and the
generator of synthetic network-automation sessions the demo model is trained on.

Everything here is deterministic in its ``random.Random`` seed. The same code serves two users:

* :mod:`tensorverse.demo.model` renders generated sessions with the Qwen3 chat template (the
  tokenizer's own, exactly as vLLM renders a prompt) and trains on the assistant's turns;
* :mod:`tensorverse.demo.agent` drives a scripted session through the proxy, with tool results
  from :class:`Router` (the same formats the model saw in training).

A session is ``system`` + one or more *tasks*; a task is a user request, one or two tool calls
(each answered by a ``tool`` message) and a short final answer:

=============================  ==========================================================
task                           calls
=============================  ==========================================================
``mac_owner``                  ``show_mac_address_table`` then ``show_interface`` (the port)
``describe_interface``         ``show_interface``
``set_description``            ``configure_interface_description``
``check_vlan``                 ``show_vlan``
``show_route``                 ``show_ip_route``
=============================  ==========================================================

Two places are left to chance on purpose, each a fair coin (:func:`_coin`): whether the port
from the MAC table is passed to ``show_interface`` as printed (``Gi0/0/3``) or spelled out
(``GigabitEthernet0/0/3``; the router accepts both, as IOS does), and which of two phrasings a final
answer uses. The model learns them as near-ties, like the ones real models have, and that is
where the demo's runtimes (bfloat16, float16, float32) can flip: a flip in the call becomes a
``value_mismatch`` at ``$.arguments.interface``.

The model's assistant turns are exactly what the template renders for a message with
``tool_calls`` (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, arguments in
``json.dumps`` form, keys in schema order) or a plain ``content`` string; no ``<think>`` block.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SYSTEM_PROMPT",
    "TOOLS",
    "TASK_KINDS",
    "Router",
    "Task",
    "Call",
    "canonical_interface",
    "make_task",
    "make_session",
    "session_messages",
    "tool_call_text",
]

SYSTEM_PROMPT = "You are NetOps, a network automation agent for router r1. Use the tools, then answer briefly."


def _tool(name: str, description: str, props: dict[str, tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
                "required": list(props),
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool("show_mac_address_table", "Find the port where a MAC address is learned",
          {"mac_address": ("string", "MAC address, e.g. aabb.ccdd.eeff")}),
    _tool("show_interface", "Show the state and description of an interface",
          {"interface": ("string", "interface name, full or abbreviated")}),
    _tool("configure_interface_description", "Set the description of an interface",
          {"interface": ("string", "full interface name"), "description": ("string", "new description")}),
    _tool("show_vlan", "Show a VLAN, its name and ports", {"vlan_id": ("integer", "VLAN id")}),
    _tool("show_ip_route", "Show the route to a prefix", {"prefix": ("string", "prefix, e.g. 10.1.2.0/24")}),
]

TASK_KINDS = ("mac_owner", "describe_interface", "set_description", "check_vlan", "show_route")

# -- values -------------------------------------------------------------------------------

_FAMILIES = (  # (full name, IOS abbreviation, weight)
    ("GigabitEthernet", "Gi", 6),
    ("TenGigabitEthernet", "Te", 2),
    ("FastEthernet", "Fa", 1),
)
_PEOPLE = ("jsmith", "mgarcia", "alee", "pkumar", "tnguyen", "rbrown", "kwong", "dmiller", "sfischer", "ochen")
_SITES = ("4F-12", "2F-03", "3F-21", "1F-07", "5F-30", "6F-02", "2F-18", "3F-09")
_CUSTOMERS = ("ACME", "GLOBEX", "INITECH", "UMBRELLA", "HOOLI", "STARK", "WAYNE", "TYRELL")
_DEVICES = ("core-sw1", "core-sw2", "dist-sw3", "edge-r2", "fw1", "lb-01", "ap-4f", "printer-2f")
_PROTOCOLS = (("ospf 1", 110), ("bgp 65001", 20), ("static", 1), ("eigrp 10", 90))


def _mac(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(12))
    return f"{h[0:4]}.{h[4:8]}.{h[8:12]}"


def _vlan_id(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.4:
        return rng.randint(2, 99)
    if r < 0.85:
        return rng.randint(100, 999)
    return rng.randint(1000, 4094)


def _interface(rng: random.Random, *, subif: bool | None = None) -> tuple[str, str]:
    """(full name, abbreviation), e.g. ("GigabitEthernet0/0/1.201", "Gi0/0/1.201")."""
    fams = [f for f in _FAMILIES for _ in range(f[2])]
    full, short, _ = rng.choice(fams)
    if rng.random() < 0.6:
        slot = f"{rng.randint(0, 1)}/{rng.randint(0, 1)}/{rng.randint(0, 9)}"
    else:
        slot = f"{rng.randint(0, 2)}/{rng.randint(0, 48)}"
    if subif is None:
        subif = rng.random() < 0.35
    if subif:
        slot += f".{_vlan_id(rng)}"
    return full + slot, short + slot


def _description(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return f"desk {rng.choice(_SITES)} ({rng.choice(_PEOPLE)})"
    if r < 0.7:
        return f"uplink to {rng.choice(_DEVICES)}"
    return f"customer {rng.choice(_CUSTOMERS)} circuit {rng.randint(1000, 9999)}"


def _prefix(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.6:
        return f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.0/24"
    if r < 0.85:
        return f"172.{rng.randint(16, 31)}.{rng.randint(0, 255)}.0/24"
    return f"192.168.{rng.randint(0, 255)}.0/24"


def _next_hop(rng: random.Random) -> str:
    return f"192.168.{rng.randint(0, 9)}.{rng.randint(1, 254)}"


def canonical_interface(name: str) -> str:
    """The full name of an interface written either way (``Gi0/0/3`` -> ``GigabitEthernet0/0/3``),
    as IOS accepts both: the router keeps one state per interface whatever the spelling."""
    for full, short, _ in _FAMILIES:
        if name.startswith(short) and not name.startswith(full) and name[len(short):][:1].isdigit():
            return full + name[len(short):]
    return name


# -- the simulated router ------------------------------------------------------------------


class Router:
    """A small simulated router: answers the five tools with IOS-like text, consistently (the
    same question gets the same answer), from state drawn on demand from ``seed``.

    ``router.call(name, arguments)`` -> the tool result text (a string, as a ``tool`` message).
    Unknown tools and bad arguments get an ``% Invalid input`` line, as a router would say.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.macs: dict[str, tuple[int, str, str]] = {}  # mac -> (vlan, port full, port short)
        self.interfaces: dict[str, dict[str, Any]] = {}
        self.vlans: dict[int, dict[str, Any]] = {}
        self.routes: dict[str, dict[str, Any]] = {}

    # state, drawn on first use
    def _iface(self, name: str) -> dict[str, Any]:
        name = canonical_interface(name)
        st = self.interfaces.get(name)
        if st is None:
            rng = self.rng
            up = rng.random() < 0.8
            st = {
                "status": "up" if up else rng.choice(["down", "administratively down"]),
                "protocol": "up" if up else "down",
                "description": _description(rng),
            }
            self.interfaces[name] = st
        return st

    def _mac(self, mac: str) -> tuple[int, str, str]:
        st = self.macs.get(mac)
        if st is None:
            full, short = _interface(self.rng, subif=False)
            st = (_vlan_id(self.rng), full, short)
            self.macs[mac] = st
        return st

    def _vlan(self, vid: int) -> dict[str, Any]:
        st = self.vlans.get(vid)
        if st is None:
            rng = self.rng
            ports = [_interface(rng)[1] for _ in range(rng.randint(1, 3))]
            st = {
                "name": f"{rng.choice(['CUST', 'USERS', 'MGMT', 'VOICE', 'DMZ'])}-{rng.choice(_CUSTOMERS)}",
                "status": "active" if rng.random() < 0.85 else "suspended",
                "ports": ports,
            }
            self.vlans[vid] = st
        return st

    def _route(self, prefix: str) -> dict[str, Any]:
        st = self.routes.get(prefix)
        if st is None:
            rng = self.rng
            proto, distance = rng.choice(_PROTOCOLS)
            st = {
                "proto": proto,
                "distance": distance,
                "metric": rng.choice([0, 2, 10, 20, 30, 110]),
                "next_hop": _next_hop(rng),
                "via": _interface(rng, subif=False)[0],
            }
            self.routes[prefix] = st
        return st

    def set_mac(self, mac: str, vlan: int, port_full: str, port_short: str) -> None:
        self.macs[mac] = (vlan, port_full, port_short)

    def set_interface(self, name: str, **state: Any) -> None:
        self._iface(name).update(state)

    # the tools
    def call(self, name: str, arguments: dict[str, Any]) -> str:
        try:
            if name == "show_mac_address_table":
                mac = str(arguments["mac_address"])
                vlan, _full, short = self._mac(mac)
                return (f"Vlan  Mac Address     Type     Ports\n"
                        f"{vlan:<5} {mac}  DYNAMIC  {short}")
            if name == "show_interface":
                ifname = str(arguments["interface"])
                st = self._iface(ifname)
                return (f"{ifname} is {st['status']}, line protocol is {st['protocol']}\n"
                        f"  Description: {st['description']}")
            if name == "configure_interface_description":
                ifname = str(arguments["interface"])
                desc = str(arguments["description"])
                self._iface(ifname)["description"] = desc
                return f"OK: {ifname} description set"
            if name == "show_vlan":
                vid = int(arguments["vlan_id"])
                st = self._vlan(vid)
                return f"VLAN {vid}  name {st['name']}  status {st['status']}\n  ports {', '.join(st['ports'])}"
            if name == "show_ip_route":
                prefix = str(arguments["prefix"])
                st = self._route(prefix)
                return (f"Routing entry for {prefix}\n"
                        f"  Known via \"{st['proto']}\", distance {st['distance']}, metric {st['metric']}\n"
                        f"  * {st['next_hop']}, via {st['via']}")
        except (KeyError, TypeError, ValueError):
            return "% Invalid input detected"
        return f"% Unknown command: {name}"


# -- tasks --------------------------------------------------------------------------------


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]
    result: str = ""


@dataclass
class Task:
    kind: str
    user: str
    calls: list[Call] = field(default_factory=list)
    answer: str = ""


_ASK = {
    "mac_owner": (
        "Find the owner of MAC {mac}.",
        "Who is behind MAC address {mac}?",
        "Where is {mac} connected?",
        "Find the port and owner of {mac}.",
        "Which desk has MAC {mac}?",
    ),
    "describe_interface": (
        "Describe interface {ifname}.",
        "Show me {ifname}.",
        "What is the state of {ifname}?",
        "Is {ifname} up?",
        "Check interface {ifname}.",
    ),
    "set_description": (
        'Set the description of {ifname} to "{desc}".',
        'Label {ifname} as "{desc}".',
        'Change the description on {ifname} to "{desc}".',
        'Describe {ifname} as "{desc}" in the config.',
    ),
    "check_vlan": (
        "Check VLAN {vid}.",
        "Is VLAN {vid} active?",
        "Which ports are in VLAN {vid}?",
        "Show VLAN {vid}.",
    ),
    "show_route": (
        "Show the route for {prefix}.",
        "How do we reach {prefix}?",
        "What is the next hop for {prefix}?",
        "Check routing to {prefix}.",
    ),
}


def _coin(rng: random.Random) -> bool:
    """A fair choice between two equally right ways to say something. The trained model keeps
    these as genuine near-ties (about 50/50), as real models have them: the places where a
    runtime's rounding can flip the greedy token."""
    return rng.random() < 0.5


def make_task(rng: random.Random, router: Router, kind: str | None = None,
              values: dict[str, Any] | None = None) -> Task:
    """One task with its calls, results (from ``router``) and final answer. ``values`` fixes
    the task's entities (``mac``, ``ifname``, ``desc``, ``vid``, ``prefix``) and ``template``
    (an index into the phrasings); the rest is drawn from ``rng``."""
    kind = kind or rng.choice(TASK_KINDS)
    v = dict(values or {})
    phrasings = _ASK[kind]
    template = phrasings[v.pop("template")] if "template" in v else rng.choice(phrasings)
    if kind == "mac_owner":
        mac = v.get("mac") or _mac(rng)
        t = Task(kind, template.format(mac=mac))
        c1 = Call("show_mac_address_table", {"mac_address": mac})
        c1.result = router.call(c1.name, c1.arguments)
        vlan, full, short = router._mac(mac)
        port = full if _coin(rng) else short  # as the table printed it, or spelled out: both valid
        c2 = Call("show_interface", {"interface": port})
        c2.result = router.call(c2.name, c2.arguments)
        desc = router._iface(full)["description"]
        t.calls = [c1, c2]
        t.answer = (f"{mac} is on {port} in VLAN {vlan}: {desc}." if _coin(rng)
                    else f"{mac} is on {port} (VLAN {vlan}), {desc}.")
        return t
    if kind == "describe_interface":
        ifname = v.get("ifname") or _interface(rng)[0]
        t = Task(kind, template.format(ifname=ifname))
        c = Call("show_interface", {"interface": ifname})
        c.result = router.call(c.name, c.arguments)
        st = router._iface(ifname)
        t.calls = [c]
        t.answer = (f"{ifname} is {st['status']}/{st['protocol']}: {st['description']}." if _coin(rng)
                    else f"{ifname} is {st['status']}, line protocol {st['protocol']}: {st['description']}.")
        return t
    if kind == "set_description":
        ifname = v.get("ifname") or _interface(rng)[0]
        desc = v.get("desc") or _description(rng)
        t = Task(kind, template.format(ifname=ifname, desc=desc))
        c = Call("configure_interface_description", {"interface": ifname, "description": desc})
        c.result = router.call(c.name, c.arguments)
        t.calls = [c]
        t.answer = f'Done: {ifname} is now "{desc}".' if _coin(rng) else f'Done, {ifname} now reads "{desc}".'
        return t
    if kind == "check_vlan":
        vid = int(v.get("vid") or _vlan_id(rng))
        t = Task(kind, template.format(vid=vid))
        c = Call("show_vlan", {"vlan_id": vid})
        c.result = router.call(c.name, c.arguments)
        st = router._vlan(vid)
        t.calls = [c]
        ports = ", ".join(st["ports"])
        t.answer = (f"VLAN {vid} ({st['name']}) is {st['status']} on {ports}." if _coin(rng)
                    else f"VLAN {vid} ({st['name']}) is {st['status']}; ports {ports}.")
        return t
    if kind == "show_route":
        prefix = v.get("prefix") or _prefix(rng)
        t = Task(kind, template.format(prefix=prefix))
        c = Call("show_ip_route", {"prefix": prefix})
        c.result = router.call(c.name, c.arguments)
        st = router._route(prefix)
        t.calls = [c]
        how = "goes" if _coin(rng) else "is reached"
        t.answer = f"{prefix} {how} via {st['next_hop']} on {st['via']} ({st['proto'].split()[0]})."
        return t
    raise ValueError(f"unknown task kind {kind!r}")


def make_session(rng: random.Random, n_tasks: int, router: Router | None = None) -> list[Task]:
    router = router or Router(rng.randrange(2**31))
    return [make_task(rng, router) for _ in range(n_tasks)]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """What the model writes for one call (the chat template's rendering of it)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def assistant_call_message(call: Call, call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }],
    }


def session_messages(tasks: list[Task]) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Chat messages for a whole session, and the assistant turns as (index of the message,
    text the model must write for it)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    targets: list[tuple[int, str]] = []
    n = 0
    for t in tasks:
        msgs.append({"role": "user", "content": t.user})
        for c in t.calls:
            targets.append((len(msgs), tool_call_text(c.name, c.arguments)))
            msgs.append(assistant_call_message(c, f"call_{n}"))
            msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": c.result})
            n += 1
        targets.append((len(msgs), t.answer))
        msgs.append({"role": "assistant", "content": t.answer})
    return msgs, targets

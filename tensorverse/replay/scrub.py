"""The scrubber: recorded text -> consistent, format-preserving placeholders.

What is replaced (``kind`` in the report), and by what:

``ipv4``      addresses outside the reserved ranges -> documentation addresses (192.0.2.0/24,
              198.51.100.0/24, 203.0.113.0/24). Structure: each original /24 gets its own block
              of 32 documentation addresses (24 blocks in all); its ``.0`` maps to the block's
              first address, its ``.255`` to the last, other hosts to the next free address of
              the block in order of appearance, so addresses that shared a subnet still do and
              network/broadcast addresses stay network/broadcast addresses. Beyond 24 networks
              (or 30 hosts in one) blocks come from 198.18.0.0/15 (RFC 2544, benchmarking; still
              never routed) and the report says so (``ipv4_overflow``). Kept as they are: netmasks
              and wildcard masks (``255.255.255.0``, ``0.0.0.255``), ``0.0.0.0/8``, loopback,
              multicast, ``255.255.255.255`` and addresses already in a reserved range.
``ipv6``      global/ULA addresses -> ``2001:db8:N::/48`` (one N per original /48; the subnet id
              is kept), interface ids above 0xffff (EUI-64, privacy addresses) -> ``face::N``;
              link-local keeps ``fe80::`` with its interface id replaced. Kept: ``::``, ``::1``,
              multicast, ``2001:db8::/32``. IPv4-mapped addresses map their IPv4 part.
``mac``       unicast MACs in any notation (``aa:bb:cc:dd:ee:ff``, ``AA-BB-...``, Cisco
              ``aabb.ccdd.eeff``) -> ``00:00:5e:00:53:NN`` (RFC 7042 documentation range), then
              locally administered ``02:00:5e:xx:xx:xx``; notation and letter case are kept.
              Broadcast, all-zero and multicast (group) MACs (STP, OSPF...) are kept.
``hostname``  device names learnt from configs and CLI output (``hostname X``, ``X#``/``X>``
              prompts, ``X(config)#``, ``Device ID: X``, ``System Name: X``, ``sysName``) ->
              ``hostN`` (case style kept), everywhere they occur as a word.
``fqdn``      domain names with a known top-level domain -> ``hostN.zoneN.domainN.example``
              (first label shares the ``hostN`` map with bare hostnames; the registered domain
              maps as a unit). Kept: RFC 2606 names (``example.com/.net/.org``, ``*.example``,
              ``*.test``, ``*.invalid``, ``*.localhost``).
``email``     ``userN@<domain mapped as above>``.
``api_key``   known token formats (OpenAI ``sk-``, GitHub ``ghp_``/``github_pat_``, Slack
              ``xox?-``, AWS ``AKIA``, Google ``AIza``, GitLab ``glpat-``, Hugging Face ``hf_``,
              JWTs, ``Bearer ...``, PEM private keys) -> the same prefix + ``REDACTED`` + a number
              (AWS: ``AKIA_REDACTED_N``, which no secret scanner takes for a key).
``secret``    passwords and keys in configs: ``password [0-9] X``, ``secret 5 $1$...``,
              ``key 7 ...``, ``key-string``, ``pre-shared-key``, ``authentication-key``,
              ``md5``, SNMPv3 ``auth``/``priv`` keys, and ``key = value`` / ``"key": "value"``
              where the key names a password, token, secret or API key. Type 7 values become a
              valid type 7 encoding of ``redactedN``; type 5/8/9 hashes become hashes of the same
              shape; plain values become ``REDACTED-SECRET-N``.
``community`` ``snmp-server community X`` -> ``communityN``.

User rules (``--rules FILE``, TOML or JSON) add patterns and words to keep, see
:func:`load_rules`.

Everything is kept that a test needs: interface names (``GigabitEthernet0/0/1.201``), commands,
VLAN ids, numbers, versions, OIDs. The mapping is one per corpus (``Scrubber``): the same original
always gives the same placeholder, different originals different placeholders. Placeholders are
themselves left alone by a later scrub (idempotent). Call :meth:`Scrubber.learn` on every text
first (the corpus scrub does): it learns device names and reserves addresses that are already
documentation addresses, so no placeholder can collide with them.

The report (:meth:`Scrubber.report`) has counts by kind, never an original.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["Scrubber", "Rule", "load_rules", "KINDS", "cisco7_encode", "cisco7_decode",
           "DOC_V4_BLOCKS", "SCRUBBER_VERSION"]

SCRUBBER_VERSION = 1

KINDS = ("ipv4", "ipv6", "mac", "hostname", "fqdn", "email", "api_key", "secret", "community")

# -------------------------------------------------------------------------------------------- IPv4

DOC_V4_BLOCKS = tuple(
    ipaddress.IPv4Network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"))
_OVERFLOW_V4 = ipaddress.IPv4Network("198.18.0.0/15")
_BLOCK = 32  # documentation addresses per original /24
_V4_KEEP = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/4", "255.255.255.255/32"))
_V4_RESERVED = (*DOC_V4_BLOCKS, _OVERFLOW_V4)

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Left boundaries also accept a JSON escape (``\n10.0.0.1`` inside a rendered JSON string).
_ESC = r"(?<=\\[nrt])"
_IPV4_RE = re.compile(rf"(?:(?<![\w.])|{_ESC}){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")


def _is_mask(ip: ipaddress.IPv4Address) -> bool:
    """A contiguous netmask (255.255.255.0) or wildcard mask (0.0.0.255)."""
    v = int(ip)
    inv = v ^ 0xFFFFFFFF
    return (inv & (inv + 1)) == 0 or (v & (v + 1)) == 0


# -------------------------------------------------------------------------------------------- IPv6

_DOC_V6 = ipaddress.IPv6Network("2001:db8::/32")
_V6_RE = re.compile(
    rf"(?:(?<![\w:.])|{_ESC})(?:[0-9A-Fa-f]{{0,4}}:){{2,7}}(?:(?<=:){_OCTET}(?:\.{_OCTET}){{3}}|[0-9A-Fa-f]{{1,4}})?"
    r"(?![\w:]|\.\d)")
_V6_CAND = re.compile(r"[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*")

# --------------------------------------------------------------------------------------------- MAC

_MAC_RE = re.compile(
    rf"(?:(?<![\w:.-])|{_ESC})(?:"
    r"(?P<colon>[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5})"
    r"|(?P<dash>[0-9A-Fa-f]{2}(?:-[0-9A-Fa-f]{2}){5})"
    r"|(?P<dot>[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4})"
    r")(?![\w:.-]*[\w:])(?!\.\w)")

# ------------------------------------------------------------------------------------- host names

_TLDS = frozenset("""
com net org edu gov mil int io co ai app dev cloud info biz me us uk de fr nl be ch at it es pt se no
dk fi pl cz ru ua jp cn kr in au nz ca br mx ar za sg hk tw il ie lu eu asia tech online site xyz
local lan corp internal intranet home priv private localdomain arpa
""".split())
_RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
_RESERVED_TLDS = ("example", "test", "invalid", "localhost")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_FQDN_RE = re.compile(rf"(?:(?<![\w.@\\-])|{_ESC})(?:{_LABEL}\.)+(?P<tld>[A-Za-z]{{2,24}})(?![\w-]|\.[A-Za-z0-9])")
_EMAIL_RE = re.compile(
    rf"(?:(?<![\w.+\\-])|{_ESC})(?P<local>[A-Za-z0-9][A-Za-z0-9._%+-]{{0,63}})@(?P<domain>(?:{_LABEL}\.)+[A-Za-z]{{2,24}})"
    r"(?![\w-])")
# Where a device names itself or its neighbours: the name is the group `name`.
_NAME = r"(?P<name>[A-Za-z][A-Za-z0-9_-]{0,62})"
_HOST_CONTEXT = [
    re.compile(rf"(?m)^\s*hostname\s+{_NAME}\s*$"),
    re.compile(rf"(?m)^{_NAME}(?:\([a-z0-9-]+\))?[#>]"),
    re.compile(rf"(?m)\b(?:Device ID|System Name|SysName|sysName)\s*:\s*{_NAME}\b"),
    re.compile(rf"(?m)^\s*(?:set\s+)?system\s+host-name\s+{_NAME}"),
]
_HOST_PLACEHOLDER = re.compile(r"(?i)^host\d+$")
# Device-like names in prose ("core-sw1", "edge-rtr2", "leaf101", "dc1-fw-02"): a network role word
# with a number. Learnt wherever they appear, so a name mentioned only in a sentence is found too.
_DEVICE_NAME = re.compile(
    r"(?i)(?<![\w./:@-])(?:[a-z0-9]+-)*(?:sw|swi|switch|rtr|router|fw|firewall|core|edge|dist|acc|access|"
    r"spine|leaf|pe|ce|gw|lb|ap|asa|nx|srx|mx|wlc|bdr|agg)[a-z]*-?\d+[a-z0-9]*(?:-[a-z0-9]+)*(?![\w-]|\.\w)")
# JSON keys whose string value names a device (tool-call arguments): learnt as host names.
_HOST_KEYS = re.compile(r"(?i)^(?:device|device_name|host|hostname|host_name|router|switch|node|target|"
                        r"peer|neighbor|sysname)$")
# CLI words a prompt-like line could capture as a "name" (``show>``, ``config#``) - never names.
_NOT_NAMES = frozenset("""
show config configure interface router switch end exit no do ip ipv6 vlan line enable disable
terminal write copy ping traceroute debug undebug clear reload user admin root localhost
""".split())

# ---------------------------------------------------------------------------------------- secrets

_API_KEY_RES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"-----BEGIN (?:[A-Z ]+ )?PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z ]+ )?PRIVATE KEY-----"),
     "pem"),
    (re.compile(r"(?<![\w-])(?P<prefix>sk-(?:proj-|ant-(?:api\d\d-)?)?)(?P<body>[A-Za-z0-9_-]{16,})"), "prefix"),
    (re.compile(r"(?<!\w)(?P<prefix>gh[pousr]_)(?P<body>[A-Za-z0-9]{30,})"), "prefix"),
    (re.compile(r"(?<!\w)(?P<prefix>github_pat_)(?P<body>\w{20,})"), "prefix"),
    (re.compile(r"(?<![\w-])(?P<prefix>xox[abposr]-)(?P<body>[A-Za-z0-9-]{10,})"), "prefix"),
    (re.compile(r"(?<![A-Za-z0-9])(?P<prefix>(?:AKIA|ASIA))(?P<body>[0-9A-Z]{16})(?![A-Za-z0-9])"), "aws"),
    (re.compile(r"(?<![\w-])(?P<prefix>AIza)(?P<body>[0-9A-Za-z_-]{35})"), "prefix"),
    (re.compile(r"(?<![\w-])(?P<prefix>glpat-)(?P<body>[\w-]{20,})"), "prefix"),
    (re.compile(r"(?<![\w-])(?P<prefix>hf_)(?P<body>[A-Za-z0-9]{30,})"), "prefix"),
    (re.compile(r"(?<![\w-])(?P<prefix>)(?P<body>eyJ[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]{8,})"), "prefix"),
    (re.compile(r"(?i)(?<!\w)(?P<prefix>(?:bearer|token)\s+)(?P<body>[A-Za-z0-9._~+/-]{20,}=*)"), "prefix"),
]
_API_PLACEHOLDER = re.compile(r"REDACTED\d+$")

# Config lines: (regex with `val` and optional `type`, kind). Keywords never match inside a
# hyphenated word (``service password-encryption`` is kept).
_KW = r"(?<![\w-])"
_KE = r"(?![\w-])"
_VAL = r"(?P<val>[^\s\"',;}]+)"
_CONFIG_RES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(rf"{_KW}snmp-server[ \t]+community[ \t]+{_VAL}"), "community"),
    (re.compile(rf"(?i){_KW}(?:password|secret|passwd|passphrase){_KE}(?P<sep>[ \t]+)(?:(?P<type>[0-9])[ \t]+)?[\"']?{_VAL}"),
     "secret"),
    (re.compile(rf"{_KW}(?:key-string|pre-shared-key|authentication-key|key|md5)[ \t]+(?P<type>[0-9])[ \t]+{_VAL}"),
     "secret"),
    # ``authentication md5 key-string 7 X``: a keyword after ``md5`` is structure, not the secret
    (re.compile(rf"{_KW}(?:key-string|pre-shared-key|authentication-key|md5|isakmp[ \t]+key)[ \t]+(?![0-9][ \t])"
                rf"(?!(?:key-string|key-chain|key)(?![\w-])){_VAL}"),
     "secret"),
    (re.compile(rf"{_KW}(?:auth[ \t]+(?:md5|sha\d*)|priv[ \t]+(?:des|3des|aes(?:[ \t]+\d+)?))[ \t]+{_VAL}"), "secret"),
    (re.compile(r"(?i)(?P<key>[\w.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|apikey|access[_-]?key"
                r"|private[_-]?key|client[_-]?secret|credentials?)[\w.-]*)[\"']?[ \t]*[:=][ \t]*[\"']?"
                r"(?P<val>[^\s\"',;}{\]\[]+)"), "secret"),
]
# Words a "password <word>" in prose is followed by: not secrets.
_NOT_SECRETS = frozenset("""
is was are be been the a an to of for and or in on at by with from as if it its this that these
those required reset change changed expired expires recovery policy policies encryption prompt
set not none null true false yes no must should will can cannot please enter new old your my
level levels length history lifetime protected type file manager database authentication
""".split())
# Keys that name a secret-ish word but hold none (``max_tokens``, ``token_ids``, ``password_policy``).
_NOT_SECRET_KEY = re.compile(r"(?i)tokens|token_?ids?|token_?count|token_?type|tokeniz|keyboard|_name$|"
                             r"(?:password|secret)_?(?:policy|length|expir|age|hint|field|prompt)")
_SECRET_PLACEHOLDER = re.compile(r"^(?:REDACTED-SECRET-\d+|community\d+|redacted\d+)$")
_SECRET_KEY_RE = re.compile(r"(?i)(password|passwd|pwd|secret|token|api[_-]?key|apikey|access[_-]?key"
                            r"|private[_-]?key|client[_-]?secret|credentials?|community)")

# Cisco type 7 (Vigenere with a fixed key): placeholders are valid type 7 strings.
_XLAT = "dsfd;kfoA,.iyewrkldJKDHSUBsgvca69834ncxv9873254k;fg87"


def cisco7_encode(plain: str, seed: int = 2) -> str:
    out = f"{seed:02d}"
    for i, ch in enumerate(plain):
        out += f"{ord(ch) ^ ord(_XLAT[(seed + i) % len(_XLAT)]):02X}"
    return out


def cisco7_decode(enc: str) -> str | None:
    try:
        seed = int(enc[:2])
        data = bytes.fromhex(enc[2:])
    except ValueError:
        return None
    return "".join(chr(b ^ ord(_XLAT[(seed + i) % len(_XLAT)])) for i, b in enumerate(data))


_CRYPT = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _crypt_filler(n: int, length: int) -> str:
    """A deterministic crypt-alphabet string of ``length`` chars for placeholder ``n``."""
    base = f"REDACTED{n}"
    return (base + "x" * length)[:length] if length >= len(base) else base[:length]


# ------------------------------------------------------------------------------------------ rules


@dataclass
class Rule:
    """A user pattern: every match of ``pattern`` (or of its group ``group``) is replaced by
    ``replacement`` with ``{n}`` the placeholder number (default ``<KIND>-{n}``)."""

    kind: str
    pattern: re.Pattern[str]
    replacement: str = ""
    group: int | str = 0

    def placeholder(self, n: int) -> str:
        return (self.replacement or f"{self.kind.upper()}-{{n}}").format(n=n)


def load_rules(path: str | Path) -> tuple[list[Rule], list[re.Pattern[str]]]:
    """Read a rules file (TOML, or JSON with the same shape)::

        keep = ["cisco\\\\.com", "ntp\\\\.org"]          # regexes: matches are never replaced
        [[rule]]
        kind = "customer_id"                          # the report's kind
        pattern = "CUST-[0-9]{6}"                     # a Python regex
        replacement = "CUST-{n:06d}"                  # optional; {n} = placeholder number
        group = 0                                     # optional: the group to replace
        ignore_case = false                           # optional

    User rules run before the built-in detectors."""
    p = Path(path)
    raw = p.read_text(encoding="utf-8")
    data = json.loads(raw) if p.suffix.lower() == ".json" else tomllib.loads(raw)
    if not isinstance(data, Mapping):
        raise ValueError(f"{p}: a rules file holds a table")
    unknown = set(data) - {"rule", "rules", "keep"}
    if unknown:
        raise ValueError(f"{p}: unknown keys {sorted(unknown)} (rule, keep)")
    rules: list[Rule] = []
    for i, r in enumerate(data.get("rule", data.get("rules", [])) or []):
        if not isinstance(r, Mapping) or not r.get("pattern") or not r.get("kind"):
            raise ValueError(f"{p}: rule {i} needs `kind` and `pattern`")
        bad = set(r) - {"kind", "pattern", "replacement", "group", "ignore_case"}
        if bad:
            raise ValueError(f"{p}: rule {i}: unknown keys {sorted(bad)}")
        try:
            rx = re.compile(r["pattern"], re.I if r.get("ignore_case") else 0)
        except re.error as e:
            raise ValueError(f"{p}: rule {i} ({r['kind']}): bad pattern: {e}") from None
        repl = str(r.get("replacement") or "")
        try:
            repl.format(n=1)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{p}: rule {i}: bad replacement template ({e})") from None
        rules.append(Rule(str(r["kind"]), rx, repl, r.get("group", 0)))
    keep = []
    for k in data.get("keep", []) or []:
        try:
            keep.append(re.compile(k))
        except re.error as e:
            raise ValueError(f"{p}: keep pattern {k!r}: {e}") from None
    return rules, keep


# ---------------------------------------------------------------------------------------- scrubber


def _case_like(template: str, word: str) -> str:
    if template.isupper():
        return word.upper()
    if template[:1].isupper() and template[1:].islower():
        return word.capitalize()
    return word


@dataclass
class _Hit:
    start: int
    end: int
    kind: str
    repl: str


@dataclass
class Scrubber:
    """One corpus's mapping (see the module docstring)."""

    rules: list[Rule] = field(default_factory=list)
    keep: list[re.Pattern[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._maps: dict[tuple[str, str], str] = {}
        self._counters: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # replacements by kind
        self._distinct: dict[str, set[str]] = {}
        self.hostnames: dict[str, str] = {}  # lower-case learnt name -> placeholder (lower)
        self._host_re: re.Pattern[str] | None = None
        self._v4_blocks: dict[int, list] = {}  # original /24 -> [(block base, next free)]
        self._v4_next_block = 0
        self._v4_taken: set[int] = set()
        self._v4_overflow = 0
        self._v6_sites: dict[int, int] = {}
        self._warnings: list[str] = []

    # -- bookkeeping ----------------------------------------------------------------------
    def _next(self, counter: str) -> int:
        self._counters[counter] = self._counters.get(counter, 0) + 1
        return self._counters[counter]

    def _mapped(self, kind: str, original: str, make: Callable[[], str]) -> str:
        key = (kind, original)
        got = self._maps.get(key)
        if got is None:
            got = self._maps[key] = make()
        return got

    def _count(self, kind: str, original: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._distinct.setdefault(kind, set()).add(original)

    def report(self) -> dict[str, Any]:
        """Counts by kind (replacements, distinct originals); never an original."""
        kinds = sorted(set(self._counts) | set(KINDS))
        return {
            "scrubber_version": SCRUBBER_VERSION,
            "replaced": {k: self._counts.get(k, 0) for k in kinds},
            "distinct": {k: len(self._distinct.get(k, ())) for k in kinds},
            "total": sum(self._counts.values()),
            "hostnames_learnt": len(self.hostnames),
            "ipv4_overflow": self._v4_overflow,
            "warnings": list(self._warnings),
        }

    # -- learning (pass 1) ------------------------------------------------------------------
    def learn(self, text: str) -> None:
        """Learn device names and reserve documentation addresses already present."""
        if not isinstance(text, str) or not text:
            return
        for rx in _HOST_CONTEXT:
            for m in rx.finditer(text):
                self._learn_host(m.group("name"))
        for m in _DEVICE_NAME.finditer(text):
            self._learn_host(m.group(0))
        for m in _FQDN_RE.finditer(text):  # the host label of a domain name is a device name too
            if m.group("tld").lower() in _TLDS and not _reserved_domain(m.group(0)) and m.group(0).count(".") >= 2:
                self._learn_host(m.group(0).split(".", 1)[0])
        for m in _IPV4_RE.finditer(text):
            ip = ipaddress.IPv4Address(m.group(0))
            if any(ip in n for n in _V4_RESERVED):
                self._v4_taken.add(int(ip))

    def learn_value(self, value: Any, key: str | None = None) -> None:
        if isinstance(value, str):
            self.learn(value)
            if key is not None and _HOST_KEYS.match(key) and re.fullmatch(r"[A-Za-z][\w-]{1,62}", value):
                self._learn_host(value)
            elif isinstance(key, str) and key == "arguments" and value[:1] == "{":
                try:  # OpenAI tool calls carry arguments as a JSON string
                    self.learn_value(json.loads(value))
                except ValueError:
                    pass
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self.learn_value(v, k if isinstance(k, str) else None)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.learn_value(v, key)

    def _learn_host(self, name: str) -> None:
        low = name.lower()
        if low in _NOT_NAMES or _HOST_PLACEHOLDER.match(name) or len(name) < 2:
            return
        if low not in self.hostnames:
            self.hostnames[low] = self._host_placeholder(low)
            self._host_re = None

    def _host_placeholder(self, low: str) -> str:
        return self._mapped("host", low, lambda: f"host{self._next('host')}")

    # -- scrubbing (pass 2) -----------------------------------------------------------------
    def scrub_text(self, text: str) -> str:
        return self.scrub_spans(text)[0]

    def scrub_spans(self, text: str) -> tuple[str, list[tuple[int, int, str]]]:
        """The scrubbed text and the replaced spans ``(start, end, replacement)`` of the original."""
        if not isinstance(text, str) or not text:
            return text, []
        hits = self._find(text)
        out: list[str] = []
        spans: list[tuple[int, int, str]] = []
        pos = 0
        for h in hits:
            out.append(text[pos:h.start])
            out.append(h.repl)
            if h.repl != text[h.start:h.end]:
                spans.append((h.start, h.end, h.repl))
            pos = h.end
        out.append(text[pos:])
        return "".join(out), spans

    def scrub_value(self, value: Any, *, key: str | None = None) -> Any:
        """Scrub every string inside a JSON-like value (dict keys are kept; a value whose key
        names a secret, e.g. ``{"password": "x"}``, is replaced whole)."""
        if isinstance(value, str):
            if key is not None and _SECRET_KEY_RE.search(key) and not _NOT_SECRET_KEY.search(key) \
                    and value and not self._kept(value) \
                    and not _SECRET_PLACEHOLDER.match(value) and not _looks_structured(value):
                kind = "community" if "community" in key.lower() else "secret"
                self._count(kind, value)
                return self._secret_placeholder(kind, value, None)
            return self.scrub_text(value)
        if isinstance(value, Mapping):
            return {k: self.scrub_value(v, key=k if isinstance(k, str) else None) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.scrub_value(v, key=key) for v in value]
        return value

    def _kept(self, s: str) -> bool:
        return any(k.search(s) for k in self.keep)

    def _keep_spans(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for k in self.keep for m in k.finditer(text)]

    def _find(self, text: str) -> list[_Hit]:
        """All hits, earlier detectors first; a later hit overlapping an earlier one is dropped."""
        taken: list[tuple[int, int]] = self._keep_spans(text)
        hits: list[_Hit] = []

        def free(s: int, e: int) -> bool:
            return all(e <= a or s >= b for a, b in taken)

        def add(s: int, e: int, kind: str, make: Callable[[], str | None]) -> None:
            if s >= e or not free(s, e):
                return
            repl = make()
            taken.append((s, e))  # claimed even when kept as is, so nothing re-scrubs a part
            if repl is None:
                return
            hits.append(_Hit(s, e, kind, repl))

        for rule in self.rules:
            for m in rule.pattern.finditer(text):
                s, e = m.span(rule.group)
                orig = m.group(rule.group)
                if orig:
                    add(s, e, rule.kind, partial(self._rule, rule, orig))
        for rx, style in _API_KEY_RES:
            for m in rx.finditer(text):
                add(m.start(), m.end(), "api_key", partial(self._api_key, m, style))
        for rx, kind in _CONFIG_RES:
            for m in rx.finditer(text):
                s, e = m.span("val")
                add(s, e, kind, partial(self._config_secret, m, kind))
        for m in _EMAIL_RE.finditer(text):
            add(m.start(), m.end(), "email", partial(self._email, m))
        for m in _MAC_RE.finditer(text):
            add(m.start(), m.end(), "mac", partial(self._mac, m))
        for m in _V6_RE.finditer(text):
            if m.group(0) and m.group(0).count(":") >= 2:
                add(m.start(), m.end(), "ipv6", partial(self._ipv6, m.group(0)))
        for m in _IPV4_RE.finditer(text):
            add(m.start(), m.end(), "ipv4", partial(self._ipv4, m.group(0)))
        for m in _FQDN_RE.finditer(text):
            add(m.start(), m.end(), "fqdn", partial(self._fqdn, m.group(0), m.group("tld")))
        if self.hostnames:
            for m in self._hostname_re().finditer(text):
                add(m.start(), m.end(), "hostname", partial(self._hostname, m.group(0)))
        hits.sort(key=lambda h: h.start)
        return hits

    # -- detectors ----------------------------------------------------------------------------
    def _rule(self, rule: Rule, orig: str) -> str | None:
        if self._placeholder_of_rule(rule, orig):
            return None
        self._count(rule.kind, orig)
        return self._mapped(f"rule:{rule.kind}", orig, lambda: rule.placeholder(self._next(f"rule:{rule.kind}")))

    def _placeholder_of_rule(self, rule: Rule, s: str) -> bool:
        return s in {v for (k, _), v in self._maps.items() if k == f"rule:{rule.kind}"}

    def _api_key(self, m: re.Match[str], style: str) -> str | None:
        orig = m.group(0)
        if style == "pem":
            if "REDACTED" in orig:
                return None
            self._count("api_key", orig)
            n = self._mapped("api_key", orig, lambda: str(self._next("api_key")))
            head = orig.split("\n", 1)[0]
            tail = orig.rsplit("\n", 1)[-1] if "\n" in orig else orig[-40:]
            return f"{head}\nREDACTED{n}\n{tail}"
        body = m.group("body")
        if _API_PLACEHOLDER.match(body) or body.startswith("REDACTED"):
            return None
        self._count("api_key", orig)
        n = self._mapped("api_key", body, lambda: str(self._next("api_key")))
        if style == "aws":  # not 16 of [0-9A-Z]: secret scanners must not take it for a key
            return m.group("prefix") + f"_REDACTED_{n}"
        return m.group("prefix") + f"REDACTED{n}"

    def _secret_placeholder(self, kind: str, orig: str, typ: str | None) -> str:
        if kind == "community":
            return self._mapped("community", orig, lambda: f"community{self._next('community')}")
        n = int(self._mapped("secret", orig, lambda: str(self._next("secret"))))
        if typ == "7":
            return cisco7_encode(f"redacted{n}")
        if typ in ("5", "8", "9", "4") and orig.startswith("$"):
            parts = orig.split("$")  # ['', '1', salt, hash]
            if len(parts) >= 4:
                return "$".join(["", parts[1], _crypt_filler(n, len(parts[2]))[:max(1, len(parts[2]))],
                                 _crypt_filler(n, len(parts[-1]))])
        return f"REDACTED-SECRET-{n}"

    def _config_secret(self, m: re.Match[str], kind: str) -> str | None:
        val = m.group("val")
        typ = m.groupdict().get("type")
        if not val or _SECRET_PLACEHOLDER.match(val) or "REDACTED" in val:
            return None
        if typ == "7" and (dec := cisco7_decode(val)) is not None and re.fullmatch(r"redacted\d+", dec):
            return None  # already a placeholder
        if typ is None and kind == "secret" and "key" not in m.groupdict():
            if val.lower() in _NOT_SECRETS or (m.groupdict().get("sep") and val.lower().rstrip(".:") in _NOT_SECRETS):
                return None
        if kind == "secret" and m.groupdict().get("key") is not None:
            if val.lower() in _NOT_SECRETS or _looks_structured(val) or _NOT_SECRET_KEY.search(m.group("key")):
                return None
        self._count(kind, val)
        return self._secret_placeholder(kind, val, typ)

    def _email(self, m: re.Match[str]) -> str | None:
        local, domain = m.group("local"), m.group("domain")
        if _reserved_domain(domain) and re.fullmatch(r"user\d+", local):
            return None
        self._count("email", m.group(0))
        new_local = self._mapped("email_local", local.lower(), lambda: f"user{self._next('email')}")
        new_domain = domain if _reserved_domain(domain) else self._domain(domain)
        return f"{new_local}@{new_domain}"

    def _mac(self, m: re.Match[str]) -> str | None:
        orig = m.group(0)
        hexd = re.sub(r"[^0-9A-Fa-f]", "", orig).lower()
        v = int(hexd, 16)
        first = v >> 40
        if v in (0, 0xFFFFFFFFFFFF) or first & 1:  # all-zero, broadcast, multicast/group
            return None
        if (v >> 8) == 0x00005E0053 or (v >> 24) == 0x02005E:  # a placeholder already
            return None
        self._count("mac", orig)

        def make() -> str:
            n = self._next("mac") - 1
            return f"00005e0053{n:02x}" if n < 256 else f"02005e{n - 256:06x}"

        new = self._mapped("mac", hexd, make)
        if m.group("dot"):
            out = ".".join(new[i:i + 4] for i in (0, 4, 8))
        else:
            sep = ":" if m.group("colon") else "-"
            out = sep.join(new[i:i + 2] for i in range(0, 12, 2))
        return out.upper() if any(c.isupper() for c in orig) and not any(c.islower() for c in orig) else out

    def _ipv4(self, s: str) -> str | None:
        ip = ipaddress.IPv4Address(s)
        if _is_mask(ip) or any(ip in n for n in _V4_KEEP) or any(ip in n for n in _V4_RESERVED):
            return None
        self._count("ipv4", s)
        return self._mapped("ipv4", s, lambda: str(self._alloc_v4(ip)))

    def _alloc_v4(self, ip: ipaddress.IPv4Address) -> ipaddress.IPv4Address:
        net = int(ip) >> 8
        host = int(ip) & 0xFF
        blocks = self._v4_blocks.setdefault(net, [])
        if host in (0, 255):
            if not blocks:
                blocks.append(self._new_v4_block())
            base = blocks[0][0]
            cand = base if host == 0 else base + _BLOCK - 1
            if cand not in self._v4_taken:
                self._v4_taken.add(cand)
                return ipaddress.IPv4Address(cand)
        for blk in blocks:
            addr = self._free_in_block(blk)
            if addr is not None:
                return ipaddress.IPv4Address(addr)
        blk = self._new_v4_block()
        blocks.append(blk)
        addr = self._free_in_block(blk)
        if addr is None:  # pragma: no cover - a new block always has room unless all taken
            addr = self._new_v4_block()[0] + 1
            self._v4_taken.add(addr)
        return ipaddress.IPv4Address(addr)

    def _free_in_block(self, blk: list) -> int | None:
        base = blk[0]
        while blk[1] < _BLOCK - 1:
            cand = base + blk[1]
            blk[1] += 1
            if cand not in self._v4_taken:
                self._v4_taken.add(cand)
                return cand
        return None

    def _new_v4_block(self) -> list:
        while True:
            i = self._v4_next_block
            self._v4_next_block += 1
            per = 256 // _BLOCK
            if i < per * len(DOC_V4_BLOCKS):
                base = int(DOC_V4_BLOCKS[i // per].network_address) + (i % per) * _BLOCK
            else:
                j = i - per * len(DOC_V4_BLOCKS)
                if j * _BLOCK >= _OVERFLOW_V4.num_addresses:
                    raise RuntimeError("scrubber: more IPv4 networks than the reserved ranges hold")
                if self._v4_overflow == 0:
                    self._warnings.append(
                        "more IPv4 networks than the documentation ranges hold: further addresses "
                        "map into 198.18.0.0/15 (RFC 2544 benchmarking range)")
                self._v4_overflow += 1
                base = int(_OVERFLOW_V4.network_address) + j * _BLOCK
            if not any(base + k in self._v4_taken for k in range(_BLOCK)):
                return [base, 1]

    def _ipv6(self, s: str) -> str | None:
        if not _V6_CAND.fullmatch(s) or ("::" not in s and s.count(":") != 7):
            return None
        try:
            ip = ipaddress.IPv6Address(s)
        except ValueError:
            return None
        if ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip in _DOC_V6:
            return None
        if ip.is_link_local and (int(ip) >> 64) == 0xFE80 << 48 and (int(ip) >> 32) & 0xFFFFFFFF == 0xFACE0000:
            return None  # a link-local placeholder (fe80::face:0:0:N)
        upper = any(c.isupper() for c in s) and not any(c.islower() for c in s)
        if ip.ipv4_mapped is not None:
            v4 = self._ipv4(str(ip.ipv4_mapped))
            if v4 is None:
                return None
            out = "::ffff:" + v4
            return out.upper() if upper else out
        self._count("ipv6", s)

        def make() -> str:
            v = int(ip)
            iid = v & ((1 << 64) - 1)
            if iid > 0xFFFF:
                iid = (0xFACE << 48) | int(self._mapped("v6iid", f"{iid:x}", lambda: str(self._next("v6iid"))))
            if ip.is_link_local:
                new = (0xFE80 << 112) | iid
            else:
                site = v >> 80
                subnet = (v >> 64) & 0xFFFF
                n = self._v6_sites.get(site)
                if n is None:
                    n = self._v6_sites[site] = len(self._v6_sites) + 1
                new = (0x20010DB8 << 96) | ((n & 0xFFFF) << 80) | (subnet << 64) | iid
            return str(ipaddress.IPv6Address(new))

        out = self._mapped("ipv6", ip.exploded, make)
        return out.upper() if upper else out

    def _domain(self, domain: str) -> str:
        """Map a domain name: registered domain as a unit, other labels one by one."""
        labels = domain.split(".")
        low = [x.lower() for x in labels]
        reg = 3 if len(low) >= 3 and len(low[-1]) == 2 and low[-2] in {"co", "com", "net", "org", "ac", "gov", "edu"} else 2
        reg = min(reg, len(low))
        registered = ".".join(low[-reg:])
        new_reg = self._mapped("domain", registered, lambda: f"domain{self._next('domain')}.example")
        rest = labels[:-reg]
        out = []
        for i, lab in enumerate(rest):
            if i == 0:
                new = self.hostnames.get(lab.lower()) or self._host_placeholder(lab.lower())
            else:
                new = self._mapped("zone", lab.lower(), lambda: f"zone{self._next('zone')}")
            out.append(_case_like(lab, new))
        return ".".join([*out, new_reg])

    def _fqdn(self, s: str, tld: str) -> str | None:
        if tld.lower() not in _TLDS or _reserved_domain(s):
            return None
        if all(part.isdigit() for part in s.split(".")[:-1]) and False:
            return None
        self._count("fqdn", s)
        return self._domain(s)

    def _hostname_re(self) -> re.Pattern[str]:
        if self._host_re is None:
            names = sorted(self.hostnames, key=len, reverse=True)
            self._host_re = re.compile(r"(?i)(?:(?<![\w.\\-])|%s)(?:%s)(?![\w-]|\.\w)"
                                       % (_ESC, "|".join(map(re.escape, names))))
        return self._host_re

    def _hostname(self, s: str) -> str | None:
        new = self.hostnames.get(s.lower())
        if new is None:
            return None
        self._count("hostname", s)
        return _case_like(s, new)


def _reserved_domain(domain: str) -> bool:
    d = domain.lower().rstrip(".")
    return any(d == r or d.endswith("." + r) for r in _RESERVED_DOMAINS) or d.rsplit(".", 1)[-1] in _RESERVED_TLDS


def _looks_structured(v: str) -> bool:
    """A JSON-ish or path-ish value that is not itself a secret (``{``, ``[``, a file path)."""
    return v[:1] in "{[" or v.startswith(("/", "./", "http://", "https://", "${", "$(", "<"))


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)

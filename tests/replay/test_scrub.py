"""The scrubber on realistic router output and configs, checked with independent detectors, plus
property tests (hypothesis): consistency, idempotence, no planted secret survives, structure kept."""

from __future__ import annotations

import ipaddress
import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tensorverse.replay.scrub import Scrubber, cisco7_decode, load_rules

ROUTER = """\
CORE-RTR1#show running-config interface GigabitEthernet0/0/1.201
Building configuration...
!
hostname CORE-RTR1
enable secret 5 $1$mERr$hx5rVt7rPNoS4wqbXKX7m0
username netops privilege 15 password 7 0822455D0A16
service password-encryption
snmp-server community Xk9!pRiv8 RO
snmp-server user monitor grp v3 auth sha AuthP4ssw0rd priv aes 128 PrivP4ssw0rd
tacacs-server key 7 104D000A0618
crypto isakmp key Sup3rS3cretPSK address 203.0.113.77
interface GigabitEthernet0/0/1.201
 description Uplink to dist-sw2.lon.acme-corp.com (ticket owner jane.doe@acme-corp.com)
 encapsulation dot1Q 201
 ip address 10.20.30.1 255.255.255.252
 ip ospf message-digest-key 1 md5 7 045802150C2E
 ipv6 address 2a02:1388:4:1201::1/64
 ipv6 address FE80::21B:54FF:FEC2:1A41 link-local
!
router bgp 65001
 neighbor 172.16.254.2 remote-as 65002
 neighbor 172.16.254.2 password BgpS3cret!
 network 10.20.30.0 mask 255.255.255.252
access-list 10 permit 10.20.0.0 0.0.255.255
ntp server 192.168.100.10
logging host 192.168.100.11
end
CORE-RTR1#show mac address-table dynamic vlan 201
          Mac Address Table
-------------------------------------------
Vlan    Mac Address       Type        Ports
----    -----------       --------    -----
 201    001b.54c2.1a41    DYNAMIC     Gi0/0/1.201
 201    0050.56A1.B2C3    DYNAMIC     Te1/1/4
 201    01:00:5e:00:00:05 STATIC      CPU
Total Mac Addresses for this criterion: 3
CORE-RTR1#show cdp neighbors detail
Device ID: dist-sw2
  IP address: 10.20.30.2
Interface: GigabitEthernet0/0/1.201,  Port ID (outgoing port): TenGigabitEthernet1/1/4
  MAC: 00:1B:54:C2:1A:42 and 00-50-56-A1-B2-C4
API: export OPENAI_API_KEY=sk-proj-Q2x7vR9mT4kL8nP3wZ6yH1jF5dS0aB; curl -H "Authorization: Bearer ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
aws_access_key_id = AKIAIOSFODNN7EXAMPLX
"""

SECRETS = ["$1$mERr$hx5rVt7rPNoS4wqbXKX7m0", "0822455D0A16", "Xk9!pRiv8", "AuthP4ssw0rd", "PrivP4ssw0rd",
           "104D000A0618", "Sup3rS3cretPSK", "045802150C2E", "BgpS3cret!",
           "sk-proj-Q2x7vR9mT4kL8nP3wZ6yH1jF5dS0aB", "ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
           "AKIAIOSFODNN7EXAMPLX"]
NAMES = ["CORE-RTR1", "dist-sw2", "acme-corp", "jane.doe", "lon.acme"]
KEPT = ["GigabitEthernet0/0/1.201", "Gi0/0/1.201", "Te1/1/4", "TenGigabitEthernet1/1/4", "dot1Q 201",
        "vlan 201", "255.255.255.252", "0.0.255.255", "remote-as 65002", "router bgp 65001",
        "show running-config interface", "show mac address-table dynamic", "service password-encryption",
        "01:00:5e:00:00:05", "Total Mac Addresses for this criterion: 3", "203.0.113.77"]

# ------------------------------------------------------------------ independent detectors
# Written separately from the scrubber's own patterns: anything they flag must be a placeholder.
_DOC4 = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15")]


def leaks(text: str) -> list[str]:
    bad = []
    for m in re.finditer(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", text):
        try:
            ip = ipaddress.ip_address(m.group())
        except ValueError:
            continue
        v = int(ip)
        mask_like = bin(v).lstrip("0b").find("01") == -1 or bin(v ^ 0xFFFFFFFF)[2:].find("01") == -1
        if not (any(ip in n for n in _DOC4) or ip.is_multicast or ip.is_loopback or mask_like
                or m.group().startswith("0.")):
            bad.append(f"ipv4 {m.group()}")
    for m in re.finditer(r"(?i)\b(?:[0-9a-f]{2}[:-]){5}[0-9a-f]{2}\b|\b[0-9a-f]{4}\.[0-9a-f]{4}\.[0-9a-f]{4}\b", text):
        h = re.sub(r"[^0-9a-fA-F]", "", m.group()).lower()
        if not (h.startswith("00005e0053") or h.startswith("02005e") or int(h[:2], 16) & 1):
            bad.append(f"mac {m.group()}")
    for m in re.finditer(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+", text):
        if not m.group().split("@")[1].endswith(".example"):
            bad.append(f"email {m.group()}")
    for m in re.finditer(r"(?i)(?:[0-9a-f]{1,4}:){3,7}[0-9a-f]{1,4}|[0-9a-f]{1,4}(?::[0-9a-f]{1,4})*::[0-9a-f:]*", text):
        try:
            ip = ipaddress.IPv6Address(m.group().rstrip(":") if m.group().endswith(":") and not m.group().endswith("::") else m.group())
        except ValueError:
            continue
        if not (ip in ipaddress.ip_network("2001:db8::/32") or ip.is_link_local and "face" in m.group().lower()
                or ip.is_loopback or ip.is_multicast):
            bad.append(f"ipv6 {m.group()}")
    for rx in (r"\bsk-(?:proj-)?(?!REDACTED)\w{16,}", r"\bghp_(?!REDACTED)\w{20,}", r"\bAKIA(?!REDACTED)[0-9A-Z]{16}\b"):
        bad += [f"key {m.group()}" for m in re.finditer(rx, text)]
    for m in re.finditer(r"(?i)\b(?:password|secret|key)\s+(?:\d\s+)?(\S+)", text):
        v = m.group(1)
        if v.lower() in ("md5", "sha", "chain", "generate", "string"):
            continue
        if not ("REDACTED" in v or re.fullmatch(r"redacted\d+", cisco7_decode(v) or "")):
            bad.append(f"secret {v}")
    return bad


def test_router_session_nothing_sensitive_survives():
    s = Scrubber()
    s.learn(ROUTER)
    out = s.scrub_text(ROUTER)
    for secret in SECRETS + NAMES:
        assert secret.lower() not in out.lower(), secret
    assert leaks(out) == [], leaks(out)
    assert leaks(ROUTER), "the detectors must flag the original"
    for k in KEPT:
        assert k in out, k
    assert out.count("\n") == ROUTER.count("\n")
    # placeholders are consistent: the same original address, name and MAC map the same way
    assert out.count("HOST1#") == 3 and "hostname HOST1" in out
    host = re.search(r"neighbor (\S+) remote-as", out).group(1)
    assert out.count(f"neighbor {host} ") == 2 and any(ipaddress.ip_address(host) in n for n in _DOC4)
    # same /24 stays the same block: 10.20.30.1, .2 and the network .0 share a documentation /27
    a1 = re.search(r"ip address (\S+) 255.255.255.252", out).group(1)
    a0 = re.search(r"network (\S+) mask", out).group(1)
    a2 = re.search(r"IP address: (\S+)", out).group(1)
    assert len({int(ipaddress.ip_address(x)) >> 5 for x in (a0, a1, a2)}) == 1
    assert int(ipaddress.ip_address(a0)) % 32 == 0  # .0 stays the block's network address
    # valid MACs, notation and case kept
    assert re.search(r"\b0000\.5e00\.53[0-9a-f]{2}\b", out)
    assert re.search(r"\b00:00:5E:00:53:[0-9A-F]{2}\b", out)
    assert re.search(r"\b00-00-5E-00-53-[0-9A-F]{2}\b", out)
    # type 7 placeholders are valid type 7
    t7 = re.search(r"password 7 (\S+)", out).group(1)
    assert re.fullmatch(r"redacted\d+", cisco7_decode(t7))
    rep = s.report()
    assert rep["replaced"]["ipv4"] >= 7 and rep["replaced"]["mac"] == 4 and rep["replaced"]["secret"] >= 8
    assert rep["replaced"]["community"] == 1 and rep["replaced"]["email"] == 1 and rep["replaced"]["api_key"] == 3
    blob = json.dumps(rep)
    for secret in SECRETS + NAMES + ["10.20.30", "172.16"]:
        assert secret not in blob


def test_scrubbing_is_idempotent_and_consistent_across_texts():
    s = Scrubber()
    s.learn(ROUTER)
    out = s.scrub_text(ROUTER)
    assert s.scrub_text(out) == out
    fresh = Scrubber()
    fresh.learn(out)
    assert fresh.scrub_text(out) == out
    # another text of the same corpus maps the same originals the same way
    again = s.scrub_text("ping 10.20.30.2 from CORE-RTR1 (mac 001b.54c2.1a41)")
    assert re.search(r"IP address: (\S+)", out).group(1) in again and "HOST1" in again
    assert "0000.5e00.5300" in again


def test_json_values_and_escapes():
    s = Scrubber()
    s.learn("hostname edge1\n")
    msg = {"role": "tool", "content": "edge1#show ip int brief\nVlan201  10.9.8.7  YES",
           "args": {"device": "edge1", "password": "hunter2-xyz", "max_tokens": 256,
                    "config": "interface Vlan201\\n10.9.8.7\\nedge1#"}}
    out = s.scrub_value(msg)
    assert out["args"]["device"] == "host1" and out["args"]["max_tokens"] == 256
    assert out["args"]["password"].startswith("REDACTED-SECRET-")
    assert "10.9.8.7" not in json.dumps(out) and "edge1" not in json.dumps(out)
    assert out["content"].startswith("host1#show ip int brief\nVlan201  192.0.2.")
    # a rendered JSON string (escaped newlines) scrubs the same way
    rendered = json.dumps(msg)
    assert "edge1" not in s.scrub_text(rendered) and "10.9.8.7" not in s.scrub_text(rendered)


def test_user_rules(tmp_path):
    f = tmp_path / "rules.toml"
    f.write_text('keep = ["cisco\\\\.com"]\n[[rule]]\nkind = "customer"\npattern = "CUST-[0-9]{6}"\n'
                 'replacement = "CUST-{n:06d}"\n')
    rules, keep = load_rules(f)
    s = Scrubber(rules=rules, keep=keep)
    out = s.scrub_text("ticket CUST-123456 see www.cisco.com and www.acme.net, CUST-123456, CUST-999999")
    assert out == "ticket CUST-000001 see www.cisco.com and host1.domain1.example, CUST-000001, CUST-000002"
    assert s.report()["replaced"]["customer"] == 3
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nkind = "x"\npattern = "("\n')
    with pytest.raises(ValueError, match="bad pattern"):
        load_rules(bad)


# ------------------------------------------------------------------------------ properties

_octet = st.integers(1, 254)
_private = st.tuples(st.sampled_from([10, 172, 100, 85, 62]), st.integers(0, 255), st.integers(0, 255), _octet
                     ).map(lambda t: ".".join(map(str, t)))
_mac = st.binary(min_size=6, max_size=6).map(lambda b: bytes([b[0] & 0xFE | 0x04]) + b[1:])  # unicast
_secret = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnpqrstuvwxyz23456789!@%^*", min_size=10, max_size=20)
_iface = st.tuples(st.sampled_from(["GigabitEthernet", "TenGigabitEthernet", "Gi", "Te", "FastEthernet"]),
                   st.integers(0, 9), st.integers(0, 9), st.integers(1, 48), st.integers(1, 4094)
                   ).map(lambda t: f"{t[0]}{t[1]}/{t[2]}/{t[3]}.{t[4]}")


def _mac_text(b: bytes, style: int) -> str:
    h = b.hex()
    if style == 0:
        return ":".join(h[i:i + 2] for i in range(0, 12, 2))
    if style == 1:
        return "-".join(h[i:i + 2] for i in range(0, 12, 2)).upper()
    return ".".join(h[i:i + 4] for i in range(0, 12, 4))


@st.composite
def configs(draw):
    ips = draw(st.lists(_private, min_size=1, max_size=6, unique=True))
    macs = draw(st.lists(_mac, min_size=1, max_size=4, unique=True))
    secrets = draw(st.lists(_secret, min_size=1, max_size=3, unique=True))
    ifaces = draw(st.lists(_iface, min_size=1, max_size=3, unique=True))
    lines = []
    for i, ip in enumerate(ips):
        iface = ifaces[i % len(ifaces)]
        lines.append(f"interface {iface}\n ip address {ip} 255.255.255.0\n description peer {ips[(i + 1) % len(ips)]}")
    for j, m in enumerate(macs):
        lines.append(f" {200 + j}    {_mac_text(m, j % 3)}    DYNAMIC     {ifaces[j % len(ifaces)]}")
    for k, sec in enumerate(secrets):
        lines.append([f"username u{k} password 0 {sec}", f"snmp-server community {sec} RO",
                      f"neighbor {ips[0]} password {sec}"][k % 3])
    text = "\n".join(lines) + "\n"
    return text, ips, macs, secrets, ifaces


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_property_no_planted_value_survives_and_structure_is_kept(cfg):
    text, ips, macs, secrets, ifaces = cfg
    # a "secret" that is part of an interface name (GigabitEth) is kept with the interface: not a leak
    assume(not any(sec in iface for sec in secrets for iface in ifaces))
    s = Scrubber()
    s.learn(text)
    out = s.scrub_text(text)
    words = set(re.findall(r"[^\s]+", out))
    for ip in ips:
        assert ip not in words
    for m in macs:
        for style in range(3):
            assert _mac_text(m, style).lower() not in out.lower()
    for sec in secrets:
        assert sec not in out
    for iface in ifaces:
        assert out.count(iface) == text.count(iface)
    assert out.count("\n") == text.count("\n")
    assert leaks(out) == []
    # idempotent, with the same and with a fresh mapping
    assert s.scrub_text(out) == out
    fresh = Scrubber()
    fresh.learn(out)
    assert fresh.scrub_text(out) == out


@settings(max_examples=60, deadline=None)
@given(st.lists(_private, min_size=2, max_size=40, unique=True), st.randoms(use_true_random=False))
def test_property_ip_mapping_is_consistent_and_injective(ips, rnd):
    s = Scrubber()
    first = {ip: s.scrub_text(f"x {ip} y").split()[1] for ip in ips}
    order = list(ips)
    rnd.shuffle(order)
    for ip in order:  # the same original, later and in another text: the same placeholder
        assert s.scrub_text(f"peer {ip}").split()[1] == first[ip]
    assert len(set(first.values())) == len(ips)  # different originals, different placeholders
    for ip, new in first.items():
        a, b = ipaddress.ip_address(ip), ipaddress.ip_address(new)
        assert any(b in n for n in _DOC4)
        for ip2, new2 in first.items():  # same /24 -> same 32-address block
            if int(a) >> 8 == int(ipaddress.ip_address(ip2)) >> 8:
                assert int(b) >> 5 == int(ipaddress.ip_address(new2)) >> 5


def test_many_networks_overflow_into_the_benchmark_range_and_say_so():
    s = Scrubber()
    outs = {s.scrub_text(f"10.{i}.0.1") for i in range(30)}
    assert len(outs) == 30
    assert all(ipaddress.ip_address(o) in ipaddress.ip_network("198.18.0.0/15") or
               any(ipaddress.ip_address(o) in n for n in _DOC4) for o in outs)
    rep = s.report()
    assert rep["ipv4_overflow"] == 6 and rep["warnings"]


def test_keywords_after_md5_are_structure_not_the_secret():
    # `authentication md5 key-string 7 X`: the secret is X (a valid type 7 placeholder), and
    # `key-string` / `key-chain` stay; `md5 <clear text>` is still replaced
    s = Scrubber()
    out = s.scrub_text("standby 1 authentication md5 key-string 7 0822455D0A16\n"
                       " ip ospf message-digest-key 1 md5 Ospf-Clear-42\n"
                       " authentication md5 key-chain KC-EDGE\n")
    assert "standby 1 authentication md5 key-string 7 " in out and "0822455D0A16" not in out
    enc = out.split("key-string 7 ")[1].split()[0]
    assert re.fullmatch(r"redacted\d+", cisco7_decode(enc) or ""), enc
    assert "Ospf-Clear-42" not in out and "message-digest-key 1 md5 REDACTED-SECRET-" in out
    assert "authentication md5 key-chain KC-EDGE" in out
    assert leaks(out) == []

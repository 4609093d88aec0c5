"""Network-automation prompts for the rig's tests: the kind of text whose tokens matter in a tool
call (interface names, VLANs, addresses)."""

PROMPTS = [
    "show mac address-table | include aabb.ccdd.eeff",
    "configure interface GigabitEthernet0/0/1.201 description uplink",
    "show ip route vrf CUSTOMER-A 10.20.30.0/24",
    "interface Vlan201\n ip address 192.168.201.1 255.255.255.0",
    "show running-config interface TenGigabitEthernet1/1/4",
    "router bgp 65001\n neighbor 10.0.0.2 remote-as 65002",
]

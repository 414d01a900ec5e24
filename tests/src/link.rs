//! Interfaces inside test namespaces: veth pairs, addresses, static neighbours and lookups
//! (`ip -j link show`).

use std::net::IpAddr;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::netns::{next_id, Netns};

/// Linux interface names hold at most 15 bytes (`IFNAMSIZ` - 1).
const IFNAME_MAX: usize = 15;

/// Creates a veth pair with one end in `a` and the other in `b` (they may be the same namespace),
/// brings both ends up and returns their names `(end_in_a, end_in_b)`.
///
/// Names are `{prefix}{a|b}{id}`, `id` a hex mix of the process id and a process-wide counter, so
/// they are unique across parallel tests and processes; `prefix` is at most 3 bytes to stay within
/// 15 bytes. Both ends are created directly inside their namespaces, so nothing ever appears in
/// the host's namespace, even if the test dies halfway.
///
/// The ends keep quiet, so counters on them move only with the test's traffic: no IPv6 link-local
/// address (so no duplicate address detection for it) and no router solicitations. What remains is
/// the kernel's MLD report or two (source `::`, ICMPv6 to `ff02::16`) right after each IPv6
/// address is added; send the test traffic from known prefixes or compare counter deltas.
pub fn veth_pair(a: &Netns, b: &Netns, prefix: &str) -> Result<(String, String)> {
    if prefix.is_empty() || prefix.len() > 3 || !prefix.bytes().all(|c| c.is_ascii_alphanumeric()) {
        bail!("veth prefix {prefix:?}: want 1-3 ASCII letters or digits");
    }
    // 22 bits of pid (pid_max is at most 2^22) and 20 bits of counter: 11 hex digits.
    let id = (u64::from(std::process::id()) << 20 | (next_id() & 0xf_ffff)) & 0x3ff_ffff_ffff;
    let name_a = format!("{prefix}a{id:x}");
    let name_b = format!("{prefix}b{id:x}");
    debug_assert!(name_a.len() <= IFNAME_MAX);
    crate::cmd::ip(&[
        "link",
        "add",
        &name_a,
        "netns",
        a.name(),
        "type",
        "veth",
        "peer",
        "name",
        &name_b,
        "netns",
        b.name(),
    ])
    .with_context(|| {
        format!(
            "creating veth pair {name_a} ({}) <-> {name_b} ({})",
            a.name(),
            b.name()
        )
    })?;
    for (ns, name) in [(a, &name_a), (b, &name_b)] {
        quiet_ipv6(ns, name)?;
        ns.ip(&["link", "set", name, "up"])?;
    }
    Ok((name_a, name_b))
}

/// Adds an address (`"198.18.0.1/24"`, `"2001:db8::1/64"`) to `ifname` in `ns`. IPv6 addresses are
/// added `nodad`, so they are usable at once instead of after duplicate address detection.
pub fn add_addr(ns: &Netns, ifname: &str, cidr: &str) -> Result<()> {
    let mut args = vec!["addr", "add", cidr, "dev", ifname];
    if cidr.contains(':') {
        args.push("nodad");
    }
    ns.ip(&args)
        .with_context(|| format!("adding {cidr} to {ifname} in {}", ns.name()))?;
    Ok(())
}

/// Adds a permanent neighbour entry `ip -> lladdr` on `ifname`, so packets to `ip` leave at once
/// with no ARP/NDP exchange (and no race with it).
pub fn add_neigh(ns: &Netns, ifname: &str, ip: IpAddr, lladdr: &str) -> Result<()> {
    ns.ip(&[
        "neigh",
        "replace",
        &ip.to_string(),
        "lladdr",
        lladdr,
        "dev",
        ifname,
        "nud",
        "permanent",
    ])?;
    Ok(())
}

/// Tells `ns`'s `ifname` that `peer_ip` lives at the MAC of `peer_ifname` in `peer_ns`: a
/// permanent neighbour entry read from the peer with [`mac`].
pub fn neigh_to_peer(
    ns: &Netns,
    ifname: &str,
    peer_ip: IpAddr,
    peer_ns: &Netns,
    peer_ifname: &str,
) -> Result<()> {
    add_neigh(ns, ifname, peer_ip, &mac(peer_ns, peer_ifname)?)
}

/// `ifname`'s MAC address in `ns`, as `aa:bb:cc:dd:ee:ff`.
pub fn mac(ns: &Netns, ifname: &str) -> Result<String> {
    let link = link_json(ns, ifname)?;
    link["address"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("`ip -j link show` gives no address for {ifname}: {link}"))
}

/// `ifname`'s MAC address in `ns`, as bytes (for frames built by hand, see [`crate::raw`]).
pub fn mac_bytes(ns: &Netns, ifname: &str) -> Result<[u8; 6]> {
    parse_mac(&mac(ns, ifname)?)
}

/// Parses a MAC address written `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let bytes = s
        .split(':')
        .map(|b| {
            (b.len() == 2)
                .then(|| u8::from_str_radix(b, 16).ok())
                .flatten()
        })
        .collect::<Option<Vec<u8>>>();
    bytes
        .and_then(|b| <[u8; 6]>::try_from(b).ok())
        .with_context(|| format!("MAC address {s:?}: want six hex bytes aa:bb:cc:dd:ee:ff"))
}

/// `ifname`'s interface index in `ns` (what XDP attach and per-interface maps use).
pub fn ifindex(ns: &Netns, ifname: &str) -> Result<u32> {
    let link = link_json(ns, ifname)?;
    link["ifindex"]
        .as_u64()
        .and_then(|i| u32::try_from(i).ok())
        .with_context(|| format!("`ip -j link show` gives no ifindex for {ifname}: {link}"))
}

fn link_json(ns: &Netns, ifname: &str) -> Result<Value> {
    let out = ns.ip(&["-j", "link", "show", "dev", ifname])?;
    let parsed: Value = serde_json::from_str(&out)
        .with_context(|| format!("parsing `ip -j link show dev {ifname}`: {out}"))?;
    match parsed {
        Value::Array(mut links) if links.len() == 1 => Ok(links.remove(0)),
        other => bail!(
            "`ip -j link show dev {ifname}` in {}: want one link, got {other}",
            ns.name()
        ),
    }
}

/// Stops the IPv6 chatter a fresh interface sends on its own (see [`veth_pair`]). Must run before
/// the interface goes up, when the link-local address would be generated.
fn quiet_ipv6(ns: &Netns, ifname: &str) -> Result<()> {
    for (knob, value) in [
        ("addr_gen_mode", "1"),
        ("router_solicitations", "0"),
        ("accept_ra", "0"),
    ] {
        ns.sysctl(&format!("net/ipv6/conf/{ifname}/{knob}"), value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_mac;

    #[test]
    fn mac_addresses_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_mac("02:00:0a:FF:00:01").unwrap(),
            [0x02, 0, 0x0a, 0xff, 0, 0x01]
        );
        for bad in [
            "",
            "02:00:0a:ff:00",
            "02:00:0a:ff:00:01:02",
            "02:00:0a:ff:00:1",
            "02:00:0a:ff:00:0g",
            "0200:0a:ff:00:01:",
        ] {
            let e = parse_mac(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad:?}: {e}");
        }
    }
}

//! The end-to-end test bed: two namespaces and the veth pair between them, with the generator's
//! frames, the receiving veth's counters and the random-source flood.

use std::{net::Ipv4Addr, time::Duration};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::{add_addr, ifindex, mac_bytes, neigh_to_peer, veth_pair, Netns};
use serde_json::Value;

use super::{ABUSER, HOT, POLITE, SERVER, SINK};
use crate::{
    generator::{blast, udp_frame, RANDOM_NET},
    refs::Refs,
};

/// The two namespaces and the veth pair between them.
pub struct Testbed {
    // Field order is drop order: the namespaces go last.
    pub(super) tx_ifindex: u32,
    pub(super) rx_if: String,
    pub(super) hot_frame: Vec<u8>,
    pub(super) random_frame: Vec<u8>,
    pub(super) rx: Netns,
    pub(super) gen: Netns,
}

impl Testbed {
    /// Creates the namespaces `rl-bench-gen-*` and `rl-bench-rx-*` and the veth pair.
    pub fn new() -> Result<Self> {
        let gen = Netns::new("rl-bench-gen")?;
        let rx = Netns::new("rl-bench-rx")?;
        let (tx_if, rx_if) = veth_pair(&gen, &rx, "rlb")?;
        add_addr(&gen, &tx_if, &format!("{HOT}/24"))?;
        add_addr(&gen, &tx_if, &format!("{POLITE}/24"))?;
        add_addr(&gen, &tx_if, &format!("{ABUSER}/24"))?;
        add_addr(&rx, &rx_if, &format!("{SERVER}/24"))?;
        neigh_to_peer(&gen, &tx_if, SERVER.into(), &rx, &rx_if)?;
        for (key, value) in [
            ("net/ipv4/ip_forward", "0"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
        ] {
            rx.sysctl(key, value)?;
        }
        rx.sysctl(&format!("net/ipv4/conf/{rx_if}/rp_filter"), "0")?;
        let rx_mac = mac_bytes(&rx, &rx_if)?;
        let tx_mac = mac_bytes(&gen, &tx_if)?;
        let hot_frame = udp_frame(rx_mac, tx_mac, HOT, SINK);
        let random_frame = udp_frame(rx_mac, tx_mac, Ipv4Addr::new(RANDOM_NET, 0, 0, 0), SINK);
        let tx_ifindex = ifindex(&gen, &tx_if)?;
        Ok(Self {
            tx_ifindex,
            rx_if,
            hot_frame,
            random_frame,
            rx,
            gen,
        })
    }

    /// `rx_packets` and `rx_dropped` of the receiving veth.
    pub fn rx_stats(&self) -> Result<(u64, u64)> {
        let out = self
            .rx
            .ip(&["-s", "-j", "link", "show", "dev", &self.rx_if])?;
        let v: Value = serde_json::from_str(&out).context("parsing `ip -s -j link show`")?;
        let rx = &v[0]["stats64"]["rx"];
        match (rx["packets"].as_u64(), rx["dropped"].as_u64()) {
            (Some(p), Some(d)) => Ok((p, d)),
            _ => bail!("no rx stats in `ip -s -j link show`: {out}"),
        }
    }

    /// The receiving namespace.
    pub fn rx(&self) -> &Netns {
        &self.rx
    }

    /// The sending namespace (the generator's, and the polite source's).
    pub fn gen(&self) -> &Netns {
        &self.gen
    }

    /// The receiving veth.
    pub fn rx_if(&self) -> &str {
        &self.rx_if
    }

    /// Runs the random-source generator for `duration`.
    pub fn blast_random(
        &self,
        refs: &Refs,
        duration: Duration,
        cpu: usize,
    ) -> Result<crate::generator::Blast> {
        blast(
            refs.random(),
            &self.gen,
            self.tx_ifindex,
            &self.random_frame,
            duration,
            cpu,
        )
    }

    pub(super) fn nft(&self, ruleset: &str) -> Result<String> {
        let path = std::env::temp_dir().join(format!("rl-bench-{}.nft", std::process::id()));
        std::fs::write(&path, ruleset)?;
        let out = self.rx.run(&["nft", "-f", &path.to_string_lossy()]);
        let _ = std::fs::remove_file(&path);
        out.context("loading the nftables rule set")
    }
}

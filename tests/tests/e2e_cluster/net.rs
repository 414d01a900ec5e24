//! The test network: a switch namespace with two bridges, the sender and four hosts; the agents
//! in it and the receivers of the flood; and taking them down at the end.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use ratelimit_testbed::{
    add_addr, assert_none_left, mac, neigh_to_peer, veth_pair, AgentProcess, Netns, Receiver,
};

use crate::{Cluster, BURST, FLOOD, GOSSIP_PORT, POLITE, PORT, RATE, SYNC_MS};

pub(crate) fn data_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 1 + u8::try_from(i).unwrap())
}

pub(crate) fn gossip_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 1 + u8::try_from(i).unwrap())
}

pub(crate) struct Host {
    pub(crate) ns: Netns,
    pub(crate) data_if: String,
    pub(crate) gossip_if: String,
}

/// The network and the keys, dropped in this order: the hosts, the sender, the switch, the key
/// directory.
pub(crate) struct Net {
    pub(crate) hosts: Vec<Host>,
    pub(crate) tx: Netns,
    sw: Netns,
    keys: TempDir,
    /// The cluster's key, h0..h2's.
    good: PathBuf,
    /// Another key, h3's.
    wrong: PathBuf,
}

/// A directory removed on drop, even when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_key(dir: &Path, name: &str, secret: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

impl Net {
    /// The keys, then the network: a switch namespace with two bridges, the sender, four hosts.
    fn build() -> Net {
        let keys = TempDir(std::env::temp_dir().join(format!("rl-cl-keys-{}", std::process::id())));
        std::fs::create_dir_all(&keys.0).unwrap();
        let good = write_key(
            &keys.0,
            "cluster.key",
            "k8Qx2v9Lm4Tz7Rb1Nc6Yh3Wd5Gf0Ps8Ju2Ea4Ko7Ui1",
        );
        let wrong = write_key(
            &keys.0,
            "wrong.key",
            "Zq1Xw2Ce3Rv4Tb5Yn6Um7Ii8Oo9Pp0Aa1Ss2Dd3Ff4G",
        );
        let sw = Netns::new("rl-cl-sw").unwrap();
        for br in ["rlbd", "rlbg"] {
            sw.ip(&["link", "add", "name", br, "type", "bridge"])
                .unwrap();
            sw.ip(&["link", "set", br, "up"]).unwrap();
        }
        let plug = |ns: &Netns, prefix: &str, bridge: &str| -> (String, String) {
            let (inside, port) = veth_pair(ns, &sw, prefix).unwrap();
            sw.ip(&["link", "set", &port, "master", bridge]).unwrap();
            (inside, port)
        };
        let tx = Netns::new("rl-cl-tx").unwrap();
        let (tx_if, _) = plug(&tx, "ct", "rlbd");
        add_addr(&tx, &tx_if, &format!("{FLOOD}/24")).unwrap();
        add_addr(&tx, &tx_if, &format!("{POLITE}/24")).unwrap();
        let mut hosts = Vec::new();
        for i in 0..4 {
            let ns = Netns::new(&format!("rl-cl-h{i}")).unwrap();
            let (data_if, data_port) = plug(&ns, "cd", "rlbd");
            let (gossip_if, _) = plug(&ns, "cg", "rlbg");
            add_addr(&ns, &data_if, &format!("{}/24", data_ip(i))).unwrap();
            add_addr(&ns, &gossip_if, &format!("{}/24", gossip_ip(i))).unwrap();
            // The hosts never send on the data link, so the bridge would never learn where their
            // MACs are and would flood every frame to every host (whose XDP would count it): pin them.
            sw.run(&[
                "bridge",
                "fdb",
                "replace",
                &mac(&ns, &data_if).unwrap(),
                "dev",
                &data_port,
                "master",
                "static",
            ])
            .unwrap();
            neigh_to_peer(&tx, &tx_if, IpAddr::V4(data_ip(i)), &ns, &data_if).unwrap();
            hosts.push(Host {
                ns,
                data_if,
                gossip_if,
            });
        }
        Net {
            hosts,
            tx,
            sw,
            keys,
            good,
            wrong,
        }
    }
}

impl Cluster {
    /// The network, then the agents (h0..h2 with the cluster key, h3 with another, all seeded
    /// with h0..h2), then a receiver of the flood on each host.
    pub(crate) fn start() -> Cluster {
        let net = Net::build();
        let mut agents = Vec::new();
        for (i, host) in net.hosts.iter().enumerate() {
            let key = if i < 3 { &net.good } else { &net.wrong };
            let agent = AgentProcess::start(&host.ns, &config(host, i, key, 3), &[])
                .unwrap_or_else(|e| panic!("agent h{i}: {e:#}"));
            agents.push(agent);
        }
        let receivers: Vec<Receiver> = (0..4)
            .map(|i| {
                Receiver::bind(
                    &net.hosts[i].ns,
                    SocketAddr::new(IpAddr::V4(data_ip(i)), PORT),
                )
                .unwrap()
            })
            .collect();
        Cluster {
            receivers,
            agents,
            down: [false; 4],
            net,
        }
    }

    /// Clean up: agents detach and unpin; namespaces go; none of this run's is left behind.
    pub(crate) fn clean_up(self) {
        // The receivers were stopped by `the_polite_source_loses_nothing`.
        let Cluster {
            agents, down, net, ..
        } = self;
        for (i, agent) in agents.into_iter().enumerate() {
            if down[i] {
                // Killed: its pins (and so the attached program) are removed by the drop.
                drop(agent);
            } else {
                agent
                    .stop()
                    .unwrap_or_else(|e| panic!("stopping h{i}: {e:#}"));
            }
        }
        let Net {
            hosts,
            tx,
            sw,
            keys,
            ..
        } = net;
        drop(hosts);
        drop(tx);
        drop(sw);
        drop(keys);
        assert_none_left("rl-cl-");
    }
}

fn config(host: &Host, i: usize, key: &Path, cluster_hosts: usize) -> String {
    let seeds: Vec<String> = (0..cluster_hosts)
        .map(|j| format!("{}:{GOSSIP_PORT}", gossip_ip(j)))
        .collect();
    format!(
        r#"[agent]
interfaces = ["{}"]
mode = "auto"

[[rule]]
name = "cluster-flood"
source = "198.18.0.0/24"
rate = {RATE}
burst = {BURST}
per = "source"
scope = "cluster"

[cluster]
listen = "{}:{GOSSIP_PORT}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {SYNC_MS}
cluster_id = "e2e-cluster"
"#,
        host.data_if,
        gossip_ip(i),
        key.display()
    )
}
